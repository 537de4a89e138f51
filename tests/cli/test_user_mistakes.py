"""User mistakes found by a review as a demanding user: each gets one line naming the culprit and a non-zero
exit, fails before any work where it can, and leaves no half-written or broken artifact behind."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import save, tiny_mlp


@pytest.fixture
def mlp_path(tmp_path):
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


@pytest.fixture
def artifact(cli, mlp_path, tmp_path):
    out = tmp_path / "art"
    assert cli("compile", mlp_path, "-o", out, "-q").code == 0
    return out


def _error(r, code, *needles) -> str:
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == code, (r.code, r.err)
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in r.err, r.err
    for n in needles:
        assert n in lines[-1], f"{n!r} not in {lines[-1]!r}"
    return lines[-1]


def test_writing_inside_an_artifact_is_refused(cli, artifact, mlp_path, tmp_path):
    _error(cli("pack", artifact, "-o", artifact / "inside.precast"), 1, "inside the artifact")
    _error(cli("compile", mlp_path, "-o", artifact / "sub", "-q"), 1, "inside the artifact")
    assert cli("pack", artifact, "-o", tmp_path / "a.precast", "-q").code == 0
    _error(cli("unpack", tmp_path / "a.precast", "-o", artifact / "un"), 1, "inside the artifact")
    assert cli("verify", artifact, "-q").code == 0  # still intact


def test_pack_does_not_overwrite_a_file_that_is_not_a_pack(cli, artifact, tmp_path):
    victim = tmp_path / "victim.onnx"
    victim.write_bytes(b"precious")
    _error(cli("pack", artifact, "-o", victim), 1, "not a packed artifact")
    assert victim.read_bytes() == b"precious"
    packed = tmp_path / "a.precast"
    assert cli("pack", artifact, "-o", packed, "-q").code == 0
    assert cli("pack", artifact, "-o", packed, "-q").code == 0  # re-packing over a pack is fine


def test_bad_report_paths_fail_before_the_compile(cli, mlp_path, tmp_path):
    (tmp_path / "afile").write_text("x")
    for option, path, needle in (
        ("--report", tmp_path, "is a directory"),
        ("--junit", tmp_path, "is a directory"),
        ("--report", tmp_path / "afile" / "r.json", "is a file, not a directory"),
        ("--cache-dir", tmp_path / "afile", "is a file, not a directory"),
    ):
        _error(cli("compile", mlp_path, "-o", tmp_path / "out", option, path), 1, option, needle)
        assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".*.tmp"))
    _error(cli("compile", mlp_path, "-o", tmp_path / "afile" / "sub"), 1, "-o", "is a file")
    _error(cli("keygen", "-o", tmp_path / "afile" / "k.pem"), 1, "is a file")


def test_an_os_error_on_a_named_path_is_a_usage_error(cli, artifact, tmp_path):
    # A path error that no command pre-checks: the top-level handler names the path, exit 1, no "internal error"
    (tmp_path / "afile").write_text("x")
    from precast.cli.main import cli as group

    @group.command("touch-for-test")
    def _touch():
        (tmp_path / "afile" / "x").write_text("")  # NotADirectoryError

    try:
        _error(cli("touch-for-test"), 1, "cannot use", "afile")
    finally:
        del group.commands["touch-for-test"]


def test_debug_works_after_the_subcommand(cli, tmp_path):
    r = cli("compile", tmp_path / "nope.onnx", "-o", tmp_path / "o", "--debug")
    assert r.code == 1 and "Traceback" in r.err and "No such option" not in r.err


def test_invalid_tolerances_are_rejected_not_blamed_on_a_pass(cli, mlp_path, tmp_path):
    for option, value, needle in (
        ("--atol", "-1", "atol"),
        ("--rtol", "nan", "rtol"),
        ("--min-cosine", "2", "min_cosine"),
    ):
        last = _error(cli("compile", mlp_path, "-o", tmp_path / "o", option, value), 1, needle)
        assert "pass" not in last
    _error(cli("bisect", mlp_path, "--atol", "-1"), 1, "atol")


def test_malformed_precast_toml(cli, mlp_path, tmp_path):
    cfg = tmp_path / "precast.toml"
    for body, needle in (
        ('[compile]\natol = "abc"\n', "atol"),
        ('[compile]\ntargets = "ort-cpu"\n', "targets must be a list"),
        ("[other]\nx = 1\n", "no [compile] table"),
    ):
        cfg.write_text(body)
        _error(cli("compile", mlp_path, "-o", tmp_path / "o", "--config", cfg), 1, needle)


def test_options_that_would_be_ignored_are_errors(cli, mlp_path, tmp_path):
    out = tmp_path / "o"
    _error(
        cli("compile", mlp_path, "-o", out, "--print-ir-after", "bogus-pass"), 1, "unknown pass 'bogus-pass'"
    )
    _error(cli("compile", mlp_path, "-o", out, "--dim", "nosuch=3"), 1, "'nosuch'", "batch")
    _error(cli("compile", mlp_path, "-o", out, "--task", "causal-lm"), 1, "--task", "ONNX file")
    _error(cli("compile", mlp_path, "-o", out, "--input", "x:float32[b,8]"), 1, "--input", "ONNX file")
    _error(
        cli("compile", mlp_path, "-o", out, "-t", "ort-cpu", "-t", "ort-cpu"), 1, "'ort-cpu' is named twice"
    )
    assert not out.exists()


def test_empty_sample_inputs_and_text_calibration_on_a_non_lm(cli, mlp_path, tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 8), np.float32))  # valid ONNX; y is empty too
    r = cli("compile", mlp_path, "-o", tmp_path / "e", "--sample-inputs", tmp_path / "empty.npz")
    assert r.code == 0 and "parity checked shapes and dtypes only" in r.err, r
    (tmp_path / "held.txt").write_text("some text to calibrate on\n")
    r = cli(
        "compile", mlp_path, "-o", tmp_path / "o", "--passes", "default,quantize-int8{mode=static}",
        "--calibration", tmp_path / "held.txt",
    )  # fmt: skip
    _error(r, 1, "--calibration text", "causal-lm")
    assert not (tmp_path / "o").exists()


def test_run_output_name_and_prefer(cli, artifact, tmp_path):
    np.savez(tmp_path / "feeds.npz", x=np.ones((2, 8), np.float32))
    r = cli("run", artifact, "-i", tmp_path / "feeds.npz", "-o", tmp_path / "res.txt")
    assert r.code == 0, r.err
    assert (tmp_path / "res.txt").is_file() and not (tmp_path / "res.txt.npz").exists()
    assert np.load(tmp_path / "res.txt")["y"].shape == (2, 4)
    _error(
        cli("run", artifact, "-i", tmp_path / "feeds.npz", "--prefer", "openvino"), 3, "no target 'openvino'"
    )
    _error(
        cli("run", artifact, "-i", tmp_path / "feeds.npz", "--prefer", "tensorrtt"),
        4,
        "unknown target 'tensorrtt'",
        "did you mean 'tensorrt'?",
    )
    _error(
        cli("run", artifact, "-i", tmp_path / "feeds.npz", "--prefer", "bogus"), 4, "unknown target 'bogus'"
    )
    _error(cli("run", artifact, "-i", tmp_path / "feeds.npz", "--threads", "0"), 1, "--threads")


def test_verify_json_reports_a_failure_on_stdout(cli, artifact):
    model = artifact / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    r = cli("verify", artifact, "--json")
    assert r.code == 3
    report = json.loads(r.out)
    assert report["ok"] is False and report["exit_code"] == 3 and "model.onnx" in report["error"]


def test_user_callable_errors_name_the_callable(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "usermods.py").write_text(
        "def bad():\n    raise ValueError('boom in user code')\nnotcallable = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    spec = ("--input", "x:float32[b,8]", "-o", tmp_path / "o")
    _error(cli("compile", "usermods:bad", *spec), 1, "'usermods:bad' raised ValueError: boom in user code")
    _error(cli("compile", "usermods:notcallable", *spec), 1, "not a torch.nn.Module or a callable")


def test_hf_folder_mistakes(cli, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    _error(cli("compile", folder, "-o", tmp_path / "o"), 1, "config.json must hold a JSON object")
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    _error(cli("compile", folder, "-o", tmp_path / "o"), 1, "add --task causal-lm")


def test_causal_lm_tokenizer_is_checked_at_compile(cli, tmp_path):
    pytest.importorskip("torch")
    from tests.llm.fixtures import build_llama

    folder = build_llama(tmp_path / "llama")
    tok = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text("garbage\n")
    _error(cli("compile", folder, "--task", "causal-lm", "-o", tmp_path / "o"), 1, "cannot read tokenizer")
    config = json.loads((folder / "config.json").read_text())
    (folder / "tokenizer.json").write_text(tok)
    config["vocab_size"] = 100  # fewer ids than the tokenizer has
    (folder / "config.json").write_text(json.dumps(config))
    _error(cli("compile", folder, "--task", "causal-lm", "-o", tmp_path / "o"), 1, "vocab_size is 100")
    assert not (tmp_path / "o").exists()


def test_python_dash_m_precast():
    r = subprocess.run([sys.executable, "-m", "precast", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "precast" in r.stdout


def test_negative_pass_and_target_options(cli, mlp_path, tmp_path):
    out = tmp_path / "o"
    for passes, needle in (
        ("fold-constants{input_size_limit=-1}", "'input_size_limit' must be >= 0"),
        ("unroll-loops{max_trip=-5}", "'max_trip' must be >= 0"),
        ("quantize-int4{percdamp=nan}", "'percdamp' must be a finite number"),
    ):
        _error(cli("compile", mlp_path, "-o", out, "--passes", passes), 1, needle)
    _error(cli("compile", mlp_path, "-o", out, "--target-option", "threads=-1"), 1, "'threads' must be >= 0")
    assert not out.exists()


def test_an_edited_manifest_io_block_is_named(cli, artifact, tmp_path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["io"]["inputs"][0]["dtype"] = "int64"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    np.savez(tmp_path / "feeds.npz", x=np.ones((2, 8), np.int64))
    _error(cli("run", artifact, "-i", tmp_path / "feeds.npz"), 3, "manifest says 'x' is int64", "float32")
    _error(cli("verify", artifact), 3, "manifest says 'x' is int64")


def test_calibration_nothing_uses_is_a_warning(cli, mlp_path, tmp_path):
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32))
    r = cli("compile", mlp_path, "-o", tmp_path / "a", "-q", "--calibration", tmp_path / "calib.npz")
    assert r.code == 0, r.err
    assert "warning: --calibration was not used" in r.err
    r = cli(
        "compile", mlp_path, "-o", tmp_path / "b", "-q", "--calibration", tmp_path / "calib.npz",
        "--passes", "default,quantize-int8{mode=static}", "--accuracy-budget", "cosine>=0.9",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "warning" not in r.err


def test_dim_on_a_causal_lm_is_refused_not_ignored(cli, tmp_path):
    """--dim was accepted and silently ignored for --task causal-lm; now a one-line error before any export."""
    from tests.llm.fixtures import build_llama

    folder = build_llama(tmp_path / "tiny-llama")
    r = cli("compile", folder, "--task", "causal-lm", "--dim", "batch=2", "-o", tmp_path / "o")
    _error(r, 1, "--dim batch", "does not apply to --task causal-lm")
    assert not (tmp_path / "o").exists()
