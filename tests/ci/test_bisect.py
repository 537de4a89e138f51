"""Parity bisection: a deliberately wrong pass, registered only here, is named by `bisect` and by `compile`."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import onnx_ir as ir
import pytest

from precast.compiler.driver import CompileOptions
from precast.compiler.verification.bisect import bisect_model
from precast.errors import EXIT_PARITY
from precast.ir import registry
from precast.ir.registry import Pass, PassResult
from tests.ci.cli_helpers import run_cli
from tests.helpers import save, tiny_mlp

WRONG = "test-scale-initializer"


class ScaleInitializer(Pass):
    """Deliberately wrong: multiplies the first float initializer by 1.5."""

    def call(self, model: ir.Model) -> PassResult:
        for value in model.graph.initializers.values():
            arr = value.const_value.numpy()
            if arr.dtype == np.float32:
                value.const_value = ir.tensor(arr * np.float32(1.5), name=value.name)
                return PassResult(model, True, {"scaled": 1})
        return PassResult(model, False, {"scaled": 0})


class BreakGraph(Pass):
    """Deliberately broken: the first MatMul becomes a com.microsoft FusedMatMul with transBatchB=1 on rank-2
    operands, which ONNX Runtime refuses to run (what onnxscript's batch-transpose rule once did to SigLIP)."""

    def call(self, model: ir.Model) -> PassResult:
        for node in model.graph:
            if node.op_type == "MatMul":
                node.op_type, node.domain = "FusedMatMul", "com.microsoft"
                node.attributes["transBatchB"] = ir.AttrInt64("transBatchB", 1)
                model.opset_imports.setdefault("com.microsoft", 1)
                return PassResult(model, True, {"broken": 1})
        return PassResult(model, False, {"broken": 0})


BREAK = "test-break-graph"
if WRONG not in registry._REGISTRY:
    registry.register(WRONG)(ScaleInitializer)
if BREAK not in registry._REGISTRY:
    registry.register(BREAK)(BreakGraph)

BAD_PIPELINE = f"infer-shapes,fold-constants,{WRONG},eliminate-dead-code"


@pytest.fixture
def model_file(tmp_path):
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def test_bisect_names_the_wrong_pass(model_file):
    result = bisect_model(str(model_file), CompileOptions(passes=BAD_PIPELINE))
    assert result.index == 2 and result.culprit == WRONG
    assert result.after == ["infer-shapes", "fold-constants"]
    assert "output 'y' max abs error" in result.error


def test_bisect_good_pipeline_is_ok(model_file):
    result = bisect_model(
        str(model_file), CompileOptions(passes="infer-shapes,fold-constants,eliminate-dead-code")
    )
    assert result.index is None and result.to_json()["ok"]


def test_bisect_cli(model_file, tmp_path, capsys):
    report = tmp_path / "bisect.json"
    code, _, err = run_cli(capsys, "bisect", model_file, "--passes", BAD_PIPELINE, "--report", report, "-q")
    assert code == EXIT_PARITY
    assert f"first broken by pass '{WRONG}'" in err and "after [infer-shapes, fold-constants]" in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback
    assert json.loads(report.read_text())["first_bad_pass"] == WRONG
    code, out, _ = run_cli(capsys, "bisect", model_file, "--passes", "fold-constants")
    assert code == 0 and "keep parity" in out


def test_compile_with_wrong_pass_fails_and_names_it(model_file, tmp_path, capsys):
    out_dir = tmp_path / "out" / "art"
    junit = tmp_path / "compile.xml"
    report = tmp_path / "compile.json"
    code, _, err = run_cli(
        capsys,
        "compile",
        model_file,
        "-o",
        out_dir,
        "--passes",
        BAD_PIPELINE,
        "--junit",
        junit,
        "--report",
        report,
        "-q",
    )
    assert code == EXIT_PARITY
    assert f"first broken by pass '{WRONG}'" in err
    assert not out_dir.exists() and list((tmp_path / "out").iterdir()) == []  # nothing half-written either
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1"
    failure = suite.find("testcase/failure")
    assert WRONG in failure.get("message")
    assert json.loads(report.read_text())["exit_code"] == EXIT_PARITY


def test_bisect_reports_each_prefix(model_file):
    from precast.compiler.driver import compile_model
    from precast.errors import ParityError
    from tests.fake_progress import RecordingProgress

    rec = RecordingProgress()
    bisect_model(str(model_file), CompileOptions(passes=BAD_PIPELINE), progress=rec)
    assert rec.steps[-1] == "bisecting 4 passes against onnxruntime on the source graph"
    prefixes = rec.advances("bisecting")
    assert [(d, t) for d, t, _ in prefixes] == [(0, 4), (1, 4), (2, 4)]  # stops at the culprit
    assert prefixes[2][2] == f"prefix 3: ..,{WRONG}"

    rec = RecordingProgress()  # the compile driver's own bisection reports the same way
    with pytest.raises(ParityError):
        compile_model(str(model_file), model_file.parent / "art", CompileOptions(passes=BAD_PIPELINE), rec)
    assert "[ort-cpu] parity failed; bisecting the pipeline" in rec.steps
    assert [(d, t) for d, t, _ in rec.advances("bisecting")] == [(0, 4), (1, 4), (2, 4)]


@pytest.mark.slow
def test_bisect_on_a_causal_lm_matches_the_compile(tmp_path):
    """`precast bisect FOLDER --task causal-lm` crashed (exit 70: GroupQueryAttention's length check) because it
    generated its own feeds instead of the causal LM's step feeds, and compared the unwritten KV rows. It now
    shares the compile's feed choice and masking: the default pipeline keeps parity, a wrong pass is named."""
    from tests.llm.fixtures import build_llama

    folder = build_llama(tmp_path / "tiny-llama")
    ok = bisect_model(str(folder), CompileOptions(task="causal-lm"))
    assert ok.index is None and ok.error is None and len(ok.passes) > 5
    bad = bisect_model(str(folder), CompileOptions(task="causal-lm", passes=BAD_PIPELINE))
    assert bad.culprit == WRONG and bad.after == ["infer-shapes", "fold-constants"]


def test_bisect_holds_a_quantized_pipeline_to_its_budget_like_compile(model_file):
    """bisect uses the compile's tolerance: a quantize pass is held to the accuracy budget (cosine), not fp32's."""
    result = bisect_model(str(model_file), CompileOptions(passes="default,quantize-int8"))
    assert result.tolerance == {"atol": None, "rtol": None, "min_cosine": 0.99}
    assert result.index is None


def test_compile_whose_graph_no_longer_runs_names_the_pass(model_file, tmp_path, capsys):
    """A pass that leaves a graph the backend refuses: exit 5 (a compile failure, not the user's input), one line
    naming the pass, nothing written."""
    from precast.errors import EXIT_COMPILE

    out_dir = tmp_path / "art"
    pipeline = f"infer-shapes,fold-constants,{BREAK},eliminate-dead-code"
    code, _, err = run_cli(capsys, "compile", model_file, "-o", out_dir, "--passes", pipeline, "-q")
    assert code == EXIT_COMPILE, err
    assert len(err.strip().splitlines()) == 1
    assert "does not run on the verification inputs" in err
    assert (
        f"first broken by pass '{BREAK}' (after [infer-shapes, fold-constants]): its graph no longer runs"
        in err
    )
    assert not out_dir.exists()
