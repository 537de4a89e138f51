"""The runner seam: one factory picks the runner from the spec's layout; every runner is a StepRunner."""

from __future__ import annotations

import pytest

from precast.artifact.llm_spec import LLMSpec
from precast.errors import ArtifactError, UsageError
from precast.runtime.llm.runners.base import StepRunner
from precast.runtime.llm.runners.factory import RunnerOptions, runner_on
from precast.runtime.llm.runners.gather import ModelRunner
from precast.runtime.llm.runners.mapped import MappedModelRunner
from tests.llm.engine.fake_runner import FakeRunner


def _spec(layout: str) -> LLMSpec:
    kv = (("past_key.0", "past_value.0"),) if layout == "mapped" else (("key_cache.0", "value_cache.0"),)
    return LLMSpec(
        architecture="tiny",
        layers=1,
        heads=1,
        kv_heads=1,
        head_size=16,
        hidden=16,
        vocab=32,
        max_context=64,
        block_size=256,
        kv_layout=layout,
        kv_inputs=kv,
        kv_outputs=kv,
        bos_id=None,
        pad_id=0,
        tokenizer="",
    )


@pytest.mark.parametrize("layout, kind", [("paged", ModelRunner), ("mapped", MappedModelRunner)])
def test_runner_on_picks_the_runner_of_the_layout(layout, kind):
    runner = runner_on(object(), _spec(layout), num_blocks=2)
    assert type(runner) is kind and isinstance(runner, StepRunner)
    assert runner.single_decoder() is None and runner.num_blocks == 2
    runner.close()


def test_ov_layout_needs_an_openvino_session_and_model_runner_refuses_mapped():
    with pytest.raises(ArtifactError, match="needs an OpenVINO artifact"):
        runner_on(object(), _spec("ov-paged"), num_blocks=2)
    with pytest.raises(UsageError, match="MappedModelRunner"):
        ModelRunner(object(), _spec("mapped"), 2)


def test_runner_options_name_the_unknown_one_and_fake_runner_is_a_step_runner():
    with pytest.raises(
        UsageError, match="unknown option 'foo' .*known: micro_batches, spinning, state_slots, threads, verify"
    ):
        RunnerOptions.from_kwargs({"foo": 1}, "Engine.load")
    assert RunnerOptions.from_kwargs({"threads": 2}, "x") == RunnerOptions(threads=2)
    fake = FakeRunner(num_blocks=8)
    assert isinstance(fake, StepRunner) and fake.kv_bytes == 0 and fake.kv_resident_bytes == 0
    fake.shutdown()
