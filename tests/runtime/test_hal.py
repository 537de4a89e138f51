"""The HAL seam (runtime/hal.py): one resolve() for load() and Engine.load, one list of target names."""

from __future__ import annotations

import pytest

from precast.errors import ArtifactError, UnknownTargetError
from precast.runtime.backends import Session
from precast.runtime.hal import TARGET_NAMES, resolve


def test_resolve_checks_the_preferred_name_and_the_signature_policy_first(tmp_path):
    with pytest.raises(UnknownTargetError, match="did you mean 'ort-qnn'"):
        resolve(tmp_path, lambda root, manifest: None, prefer="ort-qnnn")
    key = tmp_path / "key.pub"
    key.write_text("")
    with pytest.raises(ArtifactError, match="signatures live in packed artifacts"):
        resolve(tmp_path, lambda root, manifest: None, pubkey=key)


def test_the_target_registry_takes_only_the_runtime_names():
    from precast.targets.base import register_target

    assert "ort-cpu" in TARGET_NAMES
    with pytest.raises(ValueError, match="TARGET_NAMES"):
        register_target("not-a-target")


def test_sessions_expose_their_native_handle():
    from precast.runtime.backends.openvino import OpenVINOSession

    class _Compiled:
        outputs = ()

        def create_infer_request(self):
            return None

    compiled = _Compiled()
    session = OpenVINOSession(compiled, "CPU")
    assert isinstance(session, Session) and session.native is compiled


def test_rate_at_takes_the_measured_rate_nearest_the_load():
    from precast.runtime.hal import rate_at

    speed = {"decode_b1_tok_s": 100, "batch8_tok_s": 300.5, "batch32_tok_s": 900}
    assert [rate_at(speed, n) for n in (1, 2, 3, 4, 8, 15, 17, 64, 1000)] == [
        100,
        100,
        300.5,
        300.5,
        300.5,
        300.5,
        900,
        900,
        900,
    ]
    assert (
        rate_at({"decode_b1_tok_s": 5, "batch8_tok_s": 9}, 64) == 9
    )  # (an older compile: no 32-request rate)
    # an artifact is untrusted: only finite non-negative numbers count
    for bad in (
        None,
        "fast",
        [1, 2],
        {"decode_b1_tok_s": True},
        {"batch8_tok_s": float("nan")},
        {"batch32_tok_s": -1},
        {"decode_b1_tok_s": "9"},
        {"decode_b1_tok_s": 10**400},  # (a JSON integer float() cannot hold)
    ):
        assert rate_at(bad, 8) is None, bad


def test_a_speculating_caller_alone_weighs_the_verify_row_rate():
    """Speculation at batch 1 reaches between the decode rate (all drafts rejected) and the 8-token verify
    rows' rate (all kept): a speculating caller alone ranks by their geometric mean; batched callers, the
    ones that do not speculate and figures that are not numbers keep the plain rate."""
    from precast.runtime.hal import rate_at

    ort = {"decode_b1_tok_s": 160, "batch8_tok_s": 100, "batch32_tok_s": 96, "verify8_b1_tok_s": 431}
    ov = {"decode_b1_tok_s": 147, "batch8_tok_s": 183, "batch32_tok_s": 176, "verify8_b1_tok_s": 696}
    assert rate_at(ort, 1) > rate_at(ov, 1)  # plain decoding alone: ONNX Runtime
    assert abs(rate_at(ort, 1, speculative=True) - (160 * 431) ** 0.5) < 1e-9
    assert rate_at(ov, 1, speculative=True) > rate_at(ort, 1, speculative=True)  # speculating: OpenVINO
    assert rate_at(ort, 32, speculative=True) == 96  # (a batch turns speculation off: the batched rate)
    for bad in (True, float("inf"), -3, "fast", None, 10**400):
        assert rate_at({**ort, "verify8_b1_tok_s": bad}, 1, speculative=True) == 160, bad
