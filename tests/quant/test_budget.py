"""--accuracy-budget and --calibration through the compile driver and the CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import ParityError, UsageError
from precast.runtime.accuracy import check_budget, measure, parse_budget
from precast.runtime.verify import verify_artifact
from tests.helpers import save


def test_parse_budget():
    b = parse_budget("cosine>=0.99, top1>=0.95,max_abs<=0.5,ppl_delta<=0.5")
    assert [str(x) for x in b] == ["cosine>=0.99", "top1>=0.95", "max_abs<=0.5", "ppl_delta<=0.5"]
    with pytest.raises(UsageError, match="unknown accuracy metric 'cosin'"):
        parse_budget("cosin>=0.9")
    with pytest.raises(UsageError, match="cosine is bounded with '>='"):
        parse_budget("cosine<=0.9")
    with pytest.raises(UsageError, match="expected METRIC>=VALUE"):
        parse_budget("cosine=0.9")


def test_measure_and_check_name_metric_output_and_shortfall():
    ref = {"y": np.eye(4, dtype=np.float32), "ids": np.arange(3)}
    got = {"y": np.eye(4, dtype=np.float32)[[0, 1, 3, 2]], "ids": np.arange(3)}
    m = measure(ref, got)
    assert set(m) == {"y"} and m["y"]["top1"] == 0.5 and m["y"]["cosine"] == 0.5
    problems = check_budget(parse_budget("cosine>=0.99,top1>=0.9"), m)
    assert problems == [
        "cosine 0.5 on output 'y' misses cosine>=0.99 by 0.49",
        "top1 0.5 on output 'y' misses top1>=0.9 by 0.4",
    ]


@pytest.fixture
def mlp_file(tmp_path, mlp2):
    return str(save(mlp2, tmp_path / "mlp.onnx"))


def test_quantized_compile_uses_default_budget_and_records_it(tmp_path, mlp_file):
    res = compile_model(mlp_file, tmp_path / "a", CompileOptions(passes="default,quantize-int8"))
    parity = res.manifest["parity"]
    assert parity["ok"] and parity["budget"]["budget"] == "cosine>=0.99" and parity["budget"]["ok"]
    assert parity["tolerance"] == {
        "atol": None,
        "rtol": None,
        "min_cosine": 0.99,
    }  # no fp32 elementwise bound
    assert parity["budget"]["metrics"]["y"]["cosine"] >= 0.99 and "top1" in parity["outputs"]["y"]
    assert verify_artifact(tmp_path / "a")["ok"]


def test_budget_exceeded_fails_without_artifact(tmp_path, mlp_file):
    opts = CompileOptions(
        passes="default,quantize-int4{block=128}", accuracy_budget="cosine>=0.99999,top1>=0.999"
    )
    with pytest.raises(
        ParityError,
        match=r"accuracy budget exceeded: cosine 0\.99\d+ on output 'y' misses cosine>=0.99999 by",
    ):
        compile_model(mlp_file, tmp_path / "b", opts)
    assert not (tmp_path / "b").exists()


def test_budget_failure_names_every_violated_metric(tmp_path, mlp_file):
    opts = CompileOptions(
        passes="default,quantize-int4{block=128}", accuracy_budget="cosine>=0.99999,max_abs<=0.00001"
    )
    with pytest.raises(ParityError) as info:
        compile_model(mlp_file, tmp_path / "b", opts)
    violations = info.value.report["budget"]["violations"]
    assert [v.split()[0] for v in violations] == ["cosine", "max_abs"]
    assert str(info.value) == "target 'ort-cpu': accuracy budget exceeded: " + "; ".join(violations)
    assert "more" not in str(info.value) and "\n" not in str(info.value)


def test_budget_on_fp32_pipeline_still_applies(tmp_path, mlp_file):
    res = compile_model(mlp_file, tmp_path / "c", CompileOptions(accuracy_budget="top1>=1,ppl_delta<=0.5"))
    budget = res.manifest["parity"]["budget"]
    assert budget["ok"] and budget["not_measured"] == ["ppl_delta"]
    assert res.manifest["parity"]["tolerance"]["atol"] == 1e-4  # fp32 tolerances stay


def test_cli_calibration_and_budget(tmp_path, mlp_file):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "calib.npz",
        **{f"{i}/x": rng.standard_normal((4, 128)).astype(np.float32) for i in range(3)},
    )
    cmd = [
        sys.executable,
        "-c",
        "import sys; from precast.cli.main import main; main(sys.argv[1:])",
        "compile",
        mlp_file,
        "-q",
    ]
    ok = subprocess.run(
        cmd
        + [
            "-o",
            str(tmp_path / "s"),
            "-p",
            "default,quantize-int8{mode=static}",
            "--calibration",
            str(tmp_path / "calib.npz"),
            "--report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    stats = json.loads((tmp_path / "r.json").read_text())["manifest"]["passes"][-1]["stats"]
    assert stats["calibration"] == "calibration" and stats["calibration_batches"] == 3
    bad = subprocess.run(
        cmd
        + [
            "-o",
            str(tmp_path / "t"),
            "-p",
            "default,quantize-int4{block=128}",
            "--accuracy-budget",
            "cosine>=0.99999",
        ],
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode != 0
        and "accuracy budget exceeded: cosine" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    assert not (tmp_path / "t").exists()
    typo = subprocess.run(
        cmd + ["-o", str(tmp_path / "u"), "--accuracy-budget", "top2>=1"], capture_output=True, text=True
    )
    assert typo.returncode != 0 and "unknown accuracy metric 'top2'" in typo.stderr
