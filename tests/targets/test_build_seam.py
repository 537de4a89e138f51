"""The compiler -> target seam: build(model, out_dir, BuildContext) -> BuildResult, typed options, and
nothing set on the target object. Cheap: a tiny MLP, no export."""

import dataclasses

import numpy as np
import pytest

from precast.artifact.target_blocks import OrtBlock, TritonBlock
from precast.compiler.plan import CompileOptions, plan_compile
from precast.errors import UsageError
from precast.ir.registry import PassContext, PassFacts
from precast.targets.base import BuildContext, BuildResult, get_target
from tests.helpers import save, tiny_mlp


def test_ort_cpu_build_returns_a_result_and_sets_nothing_on_the_target(tmp_path):
    target = get_target("ort-cpu")({"threads": "2"})
    before = dict(vars(target))
    built = target.build(tiny_mlp(), tmp_path, BuildContext())
    assert isinstance(built, BuildResult) and isinstance(built.block, OrtBlock)
    assert built.precision == "fp32" and built.stages is None and built.llm is None and built.io is None
    assert built.block.model == "model.onnx" and built.block.session.intra_op_num_threads == 2
    assert vars(target) == before  # no context / stages / llm / io attributes
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.precision = "int8"  # type: ignore[misc]


def test_target_options_are_the_typed_frozen_instance():
    target = get_target("triton")({"max_batch_size": "4", "preferred_batch_sizes": "2,4"})
    assert target.options.max_batch_size == 4 and target.options.batch_sizes() == (2, 4)
    assert target.options.stage_counts() == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.options.threads = 3  # type: ignore[misc]
    bad = get_target("triton")({"max_batch_size": "4", "preferred_batch_sizes": "8"})
    with pytest.raises(UsageError, match=r"preferred batch size 8 is outside \[1, max_batch_size=4\]"):
        bad.check_options()


def test_triton_block_shares_ort_cpus_fields(tmp_path):
    built = get_target("triton")({"threads": "3", "mode": "tensor"}).build(
        tiny_mlp(), tmp_path, BuildContext()
    )
    assert isinstance(built.block, TritonBlock) and built.block.providers == ["CPUExecutionProvider"]
    assert built.block.session.intra_op_num_threads == 3 and built.block.offline_ort_level == "none"


def test_the_cache_key_reads_options_through_one_method(tmp_path):
    src = save(tiny_mlp(), tmp_path / "mlp.onnx")
    plan = plan_compile(str(src), tmp_path / "out", CompileOptions(target_options={"threads": "2"}))
    (tp,) = plan.targets
    assert tp.option_values() == {"ort_level": "none", "threads": 2, "runtime_level": "all"}
    assert plan.cache_key_parts("sha", "mlp")["targets"][0]["options"] == tp.option_values()


def test_build_context_defaults_and_views():
    feeds = {"x": np.zeros((1, 4), np.float32)}
    ctx = BuildContext(PassContext(sample_feeds=feeds), PassFacts(symbolic_io={"x": ("batch", 4)}))
    assert ctx.sample_feeds is feeds and ctx.facts.symbolic_io == {"x": ("batch", 4)}
    assert BuildContext().sample_feeds == {} and BuildContext().rerun_pipeline is None
