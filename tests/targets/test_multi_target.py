"""One compile, several targets; runtime.load picks the best this host runs and says why it skipped others."""

import json

import numpy as np
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import (
    PartialCompileError,
    TargetUnavailableError,
    UnknownTargetError,
)
from precast.runtime import ArtifactError, load
from precast.runtime.backends import ep_plugin
from precast.runtime.backends.tensorrt import tensorrt_available
from precast.runtime.model import preference_order
from tests.helpers import ort_run, tiny_mlp
from tests.targets.conftest import cosine

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("openvino")
# On a GPU host with TensorRT the plan would still be skipped, but the reasons differ; gpu_check.sh covers that.
pytestmark = pytest.mark.skipif(
    tensorrt_available()[0], reason="GPU host: selection is checked by gpu_check.sh"
)


@pytest.fixture(scope="module")
def multi(mlp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi") / "art"
    compile_model(str(mlp_path), out, CompileOptions(targets=["ort-cpu", "tensorrt", "ort-qnn", "openvino"]))
    return out


def test_index_lists_targets_in_fallback_order(multi):
    index = json.loads((multi / "manifest.json").read_text())
    assert index["kind"] == "multi-target"
    assert index["fallback_order"] == ["tensorrt", "ort-qnn", "openvino", "ort-cpu"]
    assert {e["precision"] for e in index["targets"].values()} == {"fp32", "fp16", "int8"}


def test_load_picks_npu_and_explains_skipped_gpu(multi, rng):
    model = load(multi)
    assert model.target == "ort-qnn" and model.providers == ["QNNExecutionProvider"]
    assert list(model.skipped) == ["tensorrt"] and "build plan" in model.skipped["tensorrt"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    assert cosine(model.run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0]) > 0.99


def test_prefer_overrides_and_unknown_prefer_is_refused(multi, rng):
    x = rng.standard_normal((2, 8)).astype(np.float32)
    for name, provider in [("openvino", "OpenVINO:CPU"), ("ort-cpu", "CPUExecutionProvider")]:
        model = load(multi, prefer=name)
        assert model.target == name and model.providers[0] == provider and model.skipped == {}
        np.testing.assert_allclose(
            model.run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-4, atol=1e-4
        )
    with pytest.raises(ArtifactError, match="no target 'triton'"):  # a target this artifact lacks
        load(multi, prefer="triton")
    with pytest.raises(
        UnknownTargetError, match="unknown target 'ort-qnnn' to prefer; did you mean 'ort-qnn'"
    ):
        load(multi, prefer="ort-qnnn")


def test_runtime_knows_every_target_name():
    from precast.runtime.backends import TARGET_NAMES
    from precast.targets import all_targets

    assert sorted(TARGET_NAMES) == sorted(all_targets())


def test_npu_missing_falls_back_to_openvino_with_reason(multi, monkeypatch):
    def no_npu(*a, **k):
        raise TargetUnavailableError("QNNExecutionProvider reports no devices on this host")

    monkeypatch.setattr(ep_plugin, "plugin_session_options", no_npu)
    model = load(multi)
    assert model.target == "openvino"
    assert list(model.skipped) == ["tensorrt", "ort-qnn"] and "no devices" in model.skipped["ort-qnn"]


def test_preference_order():
    assert preference_order(["ort-cpu", "x", "openvino", "tensorrt"]) == [
        "tensorrt",
        "openvino",
        "ort-cpu",
        "x",
    ]
    assert preference_order(["ort-cpu", "openvino"], prefer="ort-cpu") == ["ort-cpu", "openvino"]


def test_cli_run_prefer_and_targets(cli, multi, tmp_path):
    feeds = tmp_path / "x.npz"
    np.savez(feeds, x=np.ones((2, 8), np.float32))
    r = cli("run", multi, "-i", feeds)
    assert r.code == 0 and "skipped target tensorrt: " in r.err and "running target ort-qnn" in r.err
    r = cli("run", multi, "-i", feeds, "--prefer", "openvino")
    assert r.code == 0 and "running target openvino on OpenVINO:CPU" in r.err
    r = cli("targets", "--json")
    rows = json.loads(r.out)
    assert rows["ort-qnn"]["build"] and rows["ort-qnn"]["run"] and rows["openvino"]["run"]
    assert (
        rows["tensorrt"]["build"]
        and not rows["tensorrt"]["run"]
        and "libcuda" in rows["tensorrt"]["run_reason"]
    )
    assert "build plan only" in rows["tensorrt"]["build_reason"]


def test_verify_checks_every_target_and_skips_what_this_host_cannot_run(cli, multi, tmp_path):
    r = cli("verify", multi)
    assert r.code == 0, r.err
    assert "tensorrt: files intact; parity not re-run on this host" in r.out and "build plan" in r.out
    for target in ("ort-cpu", "ort-qnn", "openvino"):
        assert f"{target} y:" in r.out
    # A tampered file of the skipped target is still caught.
    plan = next(p for p in (multi / "tensorrt").rglob("*.onnx"))
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(multi, copy)
    (copy / "tensorrt" / plan.relative_to(multi / "tensorrt")).write_bytes(plan.read_bytes() + b"\0")
    r = cli("verify", copy)
    assert r.code == 3 and "modified" in r.err


def test_profile_names_a_non_ort_target_and_takes_prefer(cli, multi):
    r = cli("profile", multi, "--prefer", "openvino", "--runs", "1")
    assert r.code == 1 and "runs on openvino" in r.err and "--prefer" in r.err and "Traceback" not in r.err
    r = cli("profile", multi, "--prefer", "ort-cpu", "--runs", "1", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["target"] == "ort-cpu"


# ------------------------------------------------- one target fails: the others are still written (issue 17)

CRASH = "target 'ort-qnn' stage 'EP-context compile' crashed (SIGSEGV)"


def test_failed_target_does_not_lose_the_others(cli, mlp_path, tmp_path, child_entry, rng):
    child_entry("qnn-compile", "segfault")
    out = tmp_path / "a"
    r = cli("compile", mlp_path, "-t", "ort-cpu", "-t", "ort-qnn", "-t", "openvino", "-o", out, "-q")
    assert r.code == 5, r.err  # the failed target's exit code, so CI notices
    assert r.err.strip().splitlines()[-1] == (
        f"error: {CRASH}; wrote the other target(s) ort-cpu, openvino to {out} "
        "(the index lists the failure; --all-or-nothing writes nothing instead)"
    )
    index = json.loads((out / "manifest.json").read_text())
    assert sorted(index["targets"]) == ["openvino", "ort-cpu"] and index["fallback_order"] == [
        "openvino",
        "ort-cpu",
    ]
    assert index["failed"] == {"ort-qnn": {"error": CRASH, "error_type": "NativeCrashError", "exit_code": 5}}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "openvino", "ort-cpu"]
    assert cli("verify", out).code == 0
    x = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(
        load(out, prefer="ort-cpu").run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0], rtol=1e-5, atol=1e-5
    )


def test_all_or_nothing_writes_nothing(cli, mlp_path, tmp_path, child_entry):
    child_entry("qnn-compile", "segfault")
    r = cli(
        "compile", mlp_path, "-t", "ort-cpu", "-t", "ort-qnn", "-o", tmp_path / "a", "-q", "--all-or-nothing"
    )
    assert r.code == 5 and r.err.strip().splitlines()[-1] == f"error: {CRASH}"
    assert not (tmp_path / "a").exists()
    # the same from precast.toml; --keep-going on the command line wins over it
    (tmp_path / "precast.toml").write_text("[compile]\nall_or_nothing = true\n")
    args = (
        "compile",
        mlp_path,
        "-t",
        "ort-cpu",
        "-t",
        "ort-qnn",
        "--config",
        tmp_path / "precast.toml",
        "-q",
    )
    assert cli(*args, "-o", tmp_path / "b").code == 5 and not (tmp_path / "b").exists()
    assert (
        cli(*args, "-o", tmp_path / "c", "--keep-going").code == 5 and (tmp_path / "c" / "ort-cpu").is_dir()
    )


def test_api_raises_partial_with_the_written_result(mlp_path, tmp_path, child_entry):
    child_entry("qnn-compile", "segfault")
    with pytest.raises(PartialCompileError) as info:
        compile_model(str(mlp_path), tmp_path / "a", CompileOptions(targets=["ort-qnn", "ort-cpu"]))
    e = info.value
    assert e.exit_code == 5 and list(e.failed) == ["ort-qnn"]
    assert list(e.result.manifest["targets"]) == ["ort-cpu"] and e.result.output == tmp_path / "a"


def test_every_target_failing_writes_nothing(mlp_path, tmp_path, child_entry, monkeypatch):
    from precast.errors import NativeCrashError, PassFailedError
    from precast.targets.ort_cpu import OrtCpu

    def broken(self, model, out_dir, ctx):
        raise PassFailedError("target 'ort-cpu': broken on purpose")

    child_entry("qnn-compile", "segfault")
    monkeypatch.setattr(OrtCpu, "build", broken)
    with pytest.raises(NativeCrashError, match=r"crashed \(SIGSEGV\)"):  # the first failure, as it was
        compile_model(str(mlp_path), tmp_path / "a", CompileOptions(targets=["ort-qnn", "ort-cpu"]))
    assert not (tmp_path / "a").exists()
