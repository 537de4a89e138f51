"""split-stages: balanced cuts at layer boundaries, the tensors crossing them, and chained stages == the model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precast.errors import PassOptionError, PipelineError
from precast.ir.pipeline import parse_pipeline
from precast.ir.registry import PassContext
from precast.ir.stages import is_staged, stage_models, stage_plan
from precast.passes.split_stages import STAGE_KEY, SplitStages
from tests.helpers import ort_run
from tests.passes.stage_graphs import heavy_first_layer, residual_stack, run_chain

LAYER_BYTES = (16 * 16 + 16) * 4  # one residual_stack layer: W [16, 16] + b [16], fp32


def split(model, feeds=None, **options):
    return SplitStages(context=PassContext(sample_feeds=feeds), **options)(model)


@pytest.mark.parametrize("named", [True, False], ids=["named-layers", "structural"])
@pytest.mark.parametrize("n,cuts", [(2, ["h2"]), (3, ["h1", "h3"])])
def test_six_layers_cut_at_layer_boundaries_with_equal_bytes(named, n, cuts, rng):
    model = residual_stack(named=named)
    feeds = {"x": rng.standard_normal((3, 16)).astype(np.float32)}
    (expected,) = ort_run(model, feeds)
    result = split(model, n=n)
    per_stage = 6 // n * LAYER_BYTES
    assert result.stats == {"stages": n, "bytes": [per_stage] * n, "boundary_tensors": n - 1}
    assert all(node.metadata_props[STAGE_KEY] in {str(k) for k in range(n)} for node in result.model.graph)
    plan = stage_plan(result.model)
    assert plan["boundaries"] == [[c] for c in cuts]
    if named:
        step = 6 // n
        assert plan["layers"] == [[k * step, (k + 1) * step] for k in range(n)]
    stages = stage_models(result.model)
    assert [s.inputs for s in stages] == [["x"], *[[c] for c in cuts]]
    assert [s.outputs for s in stages] == [*[[c] for c in cuts], ["y"]]
    assert [s.bytes for s in stages] == [per_stage] * n
    got = run_chain(stages, feeds)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_tensor_read_two_stages_later_passes_through_the_stage_between(rng):
    model = residual_stack(skip=True)  # s = mean(h0), read by layer 5 only
    feeds = {"x": rng.standard_normal((2, 16)).astype(np.float32)}
    (expected,) = ort_run(model, feeds)
    result = split(model, n=3)
    s0, s1, s2 = stage_models(result.model)
    assert s0.outputs == ["s", "h1"]
    assert s1.inputs == ["s", "h1"] and s1.outputs == ["s", "h3"]  # s passed through stage 1
    assert s2.inputs == ["s", "h3"]
    assert result.stats["boundary_tensors"] == 4
    np.testing.assert_allclose(run_chain([s0, s1, s2], feeds)["y"], expected, rtol=1e-6, atol=1e-6)


def test_an_initializer_two_stages_read_is_copied_into_both_and_counted_twice(rng):
    model = residual_stack(tied=True)  # tied.w [16, 16] read by layer 0 and layer 5
    feeds = {"x": rng.standard_normal((2, 16)).astype(np.float32)}
    (expected,) = ort_run(model, feeds)
    result = split(model, n=2)
    tied = 16 * 16 * 4
    assert result.stats["bytes"] == [3 * LAYER_BYTES + tied] * 2
    s0, s1 = stage_models(result.model)
    assert "tied.w" in s0.model.graph.initializers and "tied.w" in s1.model.graph.initializers
    assert s1.inputs == ["h2"]  # a constant never crosses a cut
    np.testing.assert_allclose(run_chain([s0, s1], feeds)["y"], expected, rtol=1e-6, atol=1e-6)


def test_by_time_balances_measured_time_not_bytes():
    model = heavy_first_layer()  # layer 0: most of the time, 1/6 of the bytes
    feeds = {"x": np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)}
    (expected,) = ort_run(model, feeds)
    by_bytes = stage_plan(split(heavy_first_layer(), feeds, n=2).model)
    result = split(model, feeds, n=2, by="time")
    plan = stage_plan(result.model)
    assert by_bytes["layers"] == [[0, 3], [3, 6]]
    assert plan["by"] == "time" and plan["layers"] == [[0, 1], [1, 6]]
    assert plan["time_ms"][0] > plan["time_ms"][1] > 0  # layer 0 alone still outweighs the other five
    stages = stage_models(result.model)
    assert [s.time_ms for s in stages] == plan["time_ms"]
    np.testing.assert_allclose(run_chain(stages, feeds)["y"], expected, rtol=1e-5, atol=1e-5)


def test_by_time_without_sample_feeds_generates_them():
    result = split(residual_stack(), None, n=2, by="time")
    assert len(stage_plan(result.model)["time_ms"]) == 2


def test_more_stages_than_layers_is_one_line_naming_the_model_and_the_limit():
    p = SplitStages(n=7, context=PassContext(source_name="stack6"))
    with pytest.raises(
        PassOptionError, match=r"model 'stack6' has 6 layers, so at most 6 stages; got n=7"
    ) as e:
        p(residual_stack())
    assert "\n" not in str(e.value)
    with pytest.raises(PassOptionError, match=r"has 5 cut points, so at most 6 stages"):
        split(residual_stack(named=False), n=7)


def test_option_errors_name_the_option_and_the_choices():
    with pytest.raises(PassOptionError, match=r"option 'by' must be one of bytes\|time, got 'flops'"):
        parse_pipeline("split-stages{by=flops}")
    with pytest.raises(PassOptionError, match=r"option 'n' must be >= 2, got 1"):
        parse_pipeline("split-stages{n=1}")


def test_split_stages_must_be_the_last_pass():
    with pytest.raises(PipelineError, match=r"'split-stages' must be the last pass.*'fuse-gelu' follows it"):
        parse_pipeline("split-stages,fuse-gelu")
    specs = parse_pipeline("fuse-gelu,split-stages{n=3}")
    assert [str(s) for s in specs] == ["fuse-gelu", "split-stages{n=3}"]


def test_a_node_added_after_the_split_is_refused_when_stages_are_built():
    from onnx_ir import Node

    result = split(residual_stack(), n=2)
    graph = result.model.graph
    extra = Node("", "Relu", [graph.node(3).outputs[0]], name="late")
    graph.insert_after(graph.node(3), extra)
    with pytest.raises(
        PipelineError, match=r"node 'late' \(Relu\) has no stage: split-stages must be the last pass"
    ):
        stage_models(result.model)


def test_plan_is_recorded_on_the_model():
    model = residual_stack()
    assert not is_staged(model)
    result = split(model, n=2)
    assert is_staged(result.model)
    plan = json.loads(result.model.metadata_props["precast.stages"])
    assert plan == {
        "n": 2,
        "by": "bytes",
        "bytes": [3 * LAYER_BYTES] * 2,
        "boundaries": [["h2"]],
        "layers": [[0, 3], [3, 6]],
    }


def test_an_input_no_stage_reads_stays_an_input_of_the_first_stage():
    import onnx_ir as ir

    model = residual_stack()
    model.graph.inputs.append(
        ir.Value(name="unused", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["b"]))
    )
    s0, s1 = stage_models(split(model, n=2).model)
    assert s0.inputs == ["x", "unused"] and s1.inputs == ["h2"]
    assert [v.name for v in s0.model.graph.inputs] == ["x", "unused"]


def test_model_outputs_leave_from_the_stage_that_computes_them(rng):
    """Like a causal LM's per-layer KV outputs: each layer's h_i is also a model output."""
    model = residual_stack()
    values = {o.name: o for node in model.graph for o in node.outputs}
    model.graph.outputs.extend(values[f"h{i}"] for i in range(5))
    feeds = {"x": rng.standard_normal((2, 16)).astype(np.float32)}
    names = [o.name for o in model.graph.outputs]
    expected = dict(zip(names, ort_run(model, feeds)))
    result = split(model, n=3)
    assert stage_plan(result.model)["boundaries"] == [["h1"], ["h3"]]
    assert result.stats["boundary_tensors"] == 2
    s0, s1, s2 = stage_models(result.model)
    assert (s0.outputs, s1.inputs, s1.outputs) == (["h0", "h1"], ["h1"], ["h2", "h3"])
    assert (s2.inputs, s2.outputs) == (["h3"], ["h4", "y"])
    got = run_chain([s0, s1, s2], feeds)
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
