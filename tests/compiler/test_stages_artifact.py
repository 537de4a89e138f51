"""Staged artifacts (split-stages on ort-cpu): stage files + the manifest's stages block, loaded as a chain of
sessions whose outputs equal the unsplit model's; inspect shows the stages; a tampered block is exit 3 and a
wrong stage fails the compile's own parity check (exit 2)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx_ir as ir
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.runtime import load
from precast.runtime.staged.session import StagedSession
from tests.helpers import one_line_error
from tests.passes.stage_graphs import residual_stack

STAGED = "default,split-stages{n=3}"


@pytest.fixture(scope="module")
def stack_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("stack") / "stack.onnx"
    ir.save(residual_stack(skip=True), path)
    return path


@pytest.fixture(scope="module")
def stack_art(stack_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "staged"
    compile_model(str(stack_onnx), out, CompileOptions(passes=STAGED))
    return out


def _copy(art, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(art, dst)
    return dst


def _edit_manifest(art, edit) -> None:
    path = art / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_staged_artifact_holds_stage_files_and_runs_them_in_order(stack_art, stack_onnx, rng):
    names = sorted(p.relative_to(stack_art).as_posix() for p in stack_art.rglob("*.onnx"))
    assert names == ["stages/stage_0.onnx", "stages/stage_1.onnx", "stages/stage_2.onnx"]
    model = load(stack_art, threads=1)
    session = model.session
    assert isinstance(session, StagedSession)
    entries = [e for e, _ in session.stages]
    assert [e.model for e in entries] == names
    assert [e.inputs for e in entries] == [["x"], ["s", "h1"], ["s", "h3"]]
    assert model.manifest.stages.boundaries == [["s", "h1"], ["s", "h3"]]
    assert model.manifest.target.model is None  # the stages block names the files
    feeds = {"x": rng.standard_normal((5, 16)).astype(np.float32)}
    from tests.helpers import ort_run

    (expected,) = ort_run(ir.load(stack_onnx), feeds)
    np.testing.assert_allclose(model.run(feeds)["y"], expected, rtol=1e-5, atol=1e-6)


def test_a_staged_artifact_loads_without_the_compilers_dependencies(stack_art):
    from tests.helpers import run_with_imports_blocked

    r = run_with_imports_blocked(
        f"""
        import numpy as np
        import precast.runtime as rt
        from precast.runtime.verify import verify_artifact
        m = rt.load({str(stack_art)!r})
        assert m.run({{"x": np.ones((2, 16), np.float32)}})["y"].shape == (2, 16)
        assert verify_artifact({str(stack_art)!r})["ok"]
        bad = [k for k in sys.modules if k.split(".")[0] in ("torch", "onnx_ir", "onnxscript", "onnx")]
        assert not bad, bad
        print("RUNTIME-OK")
        """
    )
    assert "RUNTIME-OK" in r.stdout, r.stderr


def test_a_staged_compile_is_byte_identical_twice(stack_art, stack_onnx, tmp_path):
    again = tmp_path / "again"
    compile_model(str(stack_onnx), again, CompileOptions(passes=STAGED))
    for rel in ["manifest.json", *(f"stages/stage_{k}.onnx" for k in range(3))]:
        assert (again / rel).read_bytes() == (stack_art / rel).read_bytes(), rel


def test_ort_offline_level_is_applied_to_each_stage(stack_onnx, tmp_path, rng):
    out = tmp_path / "ext"
    opts = CompileOptions(passes=STAGED, target_options={"ort_level": "extended"})
    compile_model(str(stack_onnx), out, opts)  # parity of the chained, offline-optimized stages
    ops = [n.op_type for k in range(3) for n in ir.load(out / f"stages/stage_{k}.onnx").graph]
    assert "FusedGemm" in ops and "Relu" not in ops  # ONNX Runtime's Gemm+Relu fusion, in every stage
    assert load(out).manifest.target.offline_ort_level == "extended"


def test_inspect_shows_each_stage_and_json_has_the_block(cli, stack_art):
    r = cli("inspect", stack_art)
    assert r.code == 0, r.err
    assert "stages (3, balanced by bytes)" in r.out
    for k in range(3):
        assert f"stages/stage_{k}.onnx" in r.out
    assert "s, h1" in r.out and "s, h3" in r.out
    r = cli("inspect", stack_art, "--json")
    block = json.loads(r.out)["stages"]
    assert block["n"] == 3 and [s["layers"] for s in block["stages"]] == [[0, 2], [2, 4], [4, 6]]
    assert [s["bytes"] for s in block["stages"]] == [2176] * 3


def test_profile_runs_every_stage(cli, stack_art, tmp_path):
    r = cli("profile", stack_art, "--json", "--runs", "2", "--trace", tmp_path / "trace.json")
    assert r.code == 0, r.err
    ops = {row["op"]: row for row in json.loads(r.out)["ops"]}
    # 6 layers over 3 stage files: the scale Mul and the ReduceMean are in different stages than the Gemms
    assert ops["ReduceMean"]["nodes"] == 1 and ops["Mul"]["nodes"] == 1
    assert sum(row["nodes"] for row in ops.values() if row["op"] in ("Gemm", "FusedGemm")) == 6
    events = json.loads((tmp_path / "trace.json").read_text())
    assert any(str(ev.get("name", "")).startswith("scale") for ev in events)


def test_verify_reruns_parity_through_the_chained_stages(cli, stack_art):
    r = cli("verify", stack_art)
    assert r.code == 0, r.err
    assert "parity holds" in r.out


@pytest.mark.parametrize(
    "edit,needles",
    [
        (
            lambda m: m["stages"]["stages"][1].update(flops=1),
            ("stages block", "unknown key 'stages[1].flops'"),
        ),
        (lambda m: m["stages"]["stages"][2].update(model="../stage_2.onnx"), ("stages.stages[2].model",)),
        (lambda m: m["stages"]["stages"][1].update(inputs=["h1"]), ("stages/stage_1.onnx", "'s'")),
        (lambda m: m["stages"]["stages"][2].update(outputs=["y", "z"]), ("stages/stage_2.onnx", "'z'")),
        (
            lambda m: m["stages"]["stages"][1].update(inputs=["s", "h1", "x"]),
            ("stages/stage_1.onnx", "input 'x', which its model does not read"),
        ),
    ],
    ids=["unknown-key", "path-outside", "input-missing", "output-not-written", "input-not-read"],
)
def test_a_tampered_stages_block_is_exit_3(cli, stack_art, tmp_path, edit, needles):
    art = _copy(stack_art, tmp_path)
    _edit_manifest(art, edit)
    one_line_error(cli("verify", art), 3, *needles)


def test_a_wrong_stage_fails_the_compiles_parity_exit_2(cli, stack_onnx, tmp_path, monkeypatch):
    import precast.ir.stages as stages_mod

    real = stages_mod.stage_models

    def one_stage_wrong(model):
        stages = real(model)
        graph = stages[1].model.graph
        w = next(v for v in graph.initializers.values() if v.const_value.numpy().ndim == 2)
        w.const_value = ir.Tensor(w.const_value.numpy() * 1.5, name=w.name)
        return stages

    monkeypatch.setattr(stages_mod, "stage_models", one_stage_wrong)
    out = tmp_path / "bad"
    r = cli("compile", stack_onnx, "-o", out, "--passes", STAGED, "--quiet")
    one_line_error(r, 2, "target 'ort-cpu': parity failed: output 'y'")
    assert not out.exists()


def test_split_stages_not_last_and_targets_without_stages_are_refused_at_plan(cli, stack_onnx, tmp_path):
    r = cli("compile", stack_onnx, "-o", tmp_path / "a", "--passes", "split-stages,fuse-gelu")
    one_line_error(r, 1, "'split-stages' must be the last pass", "'fuse-gelu'")
    r = cli("compile", stack_onnx, "-o", tmp_path / "b", "--target", "openvino", "--passes", "split-stages")
    one_line_error(r, 1, "target 'openvino' cannot run a staged model", "run stages: ort-cpu, triton)")
    r = cli("compile", stack_onnx, "-o", tmp_path / "c", "--passes", "default,split-stages{n=9}", "-q")
    one_line_error(r, 1, "model 'stack' has 6 layers, so at most 6 stages; got n=9")
    assert not any((tmp_path / d).exists() for d in "abc")


# A tiny BERT (torch export, once per module) and the real all-MiniLM-L6-v2.


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from precast.compiler.frontends.source import load_source
    from tests.helpers import randomize_weights_

    cfg = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("bert")
    randomize_weights_(transformers.BertModel(cfg).eval()).save_pretrained(root / "hf")
    source = load_source(str(root / "hf"))
    arts = {}
    for name, passes in [
        ("plain", None),
        ("bytes2", "default,split-stages{n=2}"),
        ("time4", "default,split-stages{n=4,by=time}"),
    ]:
        compile_model(source, root / name, CompileOptions(passes=passes))
        arts[name] = root / name
    return arts


def _bert_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(123)  # not the compile's feeds, and other sizes
    ids = rng.integers(3, 98, size=(3, 11)).astype(np.int64)
    mask = np.ones((3, 11), dtype=np.int64)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


@pytest.mark.slow
@pytest.mark.parametrize("staged", ["bytes2", "time4"])
def test_staged_bert_matches_the_unsplit_artifact(bert, staged):
    plain, model = load(bert["plain"]), load(bert[staged], threads=1)
    spec = model.manifest.stages
    n = 2 if staged == "bytes2" else 4
    assert spec.n == n and len(model.session.stages) == n
    assert [s.layers for s in spec.stages] == ([[0, 2], [2, 4]] if n == 2 else [[k, k + 1] for k in range(4)])
    # between layers: the hidden state and the mask-derived additive mask, nothing else
    assert all(len(b) == 2 for b in spec.boundaries)
    assert all(s.time_ms is not None and s.time_ms > 0 for s in spec.stages) == (staged == "time4")
    assert spec.stages[-1].outputs == ["last_hidden_state", "pooler_output"]
    feeds = _bert_feeds()
    want, got = plain.run(feeds), model.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_minilm_chained_stages_equal_the_unsplit_graph(minilm_dir):
    from precast.compiler.frontends.source import load_source
    from precast.ir.pipeline import PassManager, clone_model, parse_pipeline
    from precast.ir.registry import PassContext
    from precast.ir.stages import stage_models
    from precast.passes.split_stages import SplitStages
    from precast.targets.ort_cpu import OrtCpu
    from tests.helpers import ort_run
    from tests.passes.stage_graphs import run_chain

    source = load_source(str(minilm_dir))
    optimized = PassManager(parse_pipeline("default", default=OrtCpu.default_pipeline)).run(source.model)
    rng = np.random.default_rng(7)
    ids = rng.integers(1000, 30000, size=(2, 24)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 15:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    want = dict(zip([o.name for o in optimized.graph.outputs], ort_run(optimized, feeds)))
    for options in ({"n": 3}, {"n": 2, "by": "time"}):
        p = SplitStages(context=PassContext(sample_feeds=feeds), **options)
        stages = stage_models(p(clone_model(optimized)).model)
        assert len(stages) == options["n"]
        layers = [s.layers for s in stages]
        assert layers[0][0] == 0 and layers[-1][1] == 6
        assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
        assert all(len(s.inputs) == 2 for s in stages[1:])  # hidden state + additive mask
        got = run_chain(stages, feeds)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{options} {name}")
