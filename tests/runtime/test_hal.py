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
