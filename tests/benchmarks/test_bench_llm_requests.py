"""benchmarks/bench_llm.py's pure parts: the mixed-length requests, the ratio arithmetic, its flags."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_llm_requests import (  # noqa: E402
    TOKENS,
    mixed_lengths,
    mixed_prompts,
    round_ratios,
    summary,
)


def test_mixed_lengths_span_the_range_evenly():
    assert mixed_lengths(8) == [32, 101, 169, 238, 306, 375, 443, 512]
    lengths = mixed_lengths(32)
    assert lengths[0] == 32 and lengths[-1] == 512 and len(set(lengths)) == 32
    steps = np.diff(lengths)
    assert steps.min() >= 15 and steps.max() <= 16  # 480 / 31 = 15.5
    assert mixed_lengths(1) == [272]
    with pytest.raises(ValueError, match="lo <= hi"):
        mixed_lengths(4, 64, 32)


def test_mixed_prompts_are_fresh_and_keep_the_token_count():
    rng = np.random.default_rng(0)
    a, b = mixed_prompts(rng, 32), mixed_prompts(rng, 32)
    for prompts in (a, b):
        assert sorted(len(p) for p in prompts) == mixed_lengths(32)  # same prompt tokens every round
        assert [len(p) for p in prompts] != mixed_lengths(32)  # shuffled
        ids = np.concatenate(prompts)
        assert ids.min() >= TOKENS[0] and ids.max() < TOKENS[1]
        # no two requests share a first KV block (16 tokens): a prefix cache cannot hit between them
        assert len({tuple(p[:16]) for p in prompts}) == 32
    assert {tuple(p[:16]) for p in a}.isdisjoint({tuple(p[:16]) for p in b})  # nor from one round to the next


def test_round_ratios_pair_rounds_and_skip_failures():
    values = {"precast-fp32": [100.0, None, 200.0, 50.0], "ov-fp32": [250.0, 300.0, None, 100.0]}
    assert round_ratios(values, "precast-fp32", "ov-fp32") == [2.5, 2.0]
    assert round_ratios(values, "precast-fp32", "genai-fp32") == []
    assert summary([2.5, 2.0, 1.0]) == "2.00x (1.00-2.50)"
    assert summary([1.5]) == "1.50x" and summary([]) == "-"


def test_bench_llm_list_skips_missing_interpreters_with_a_note(tmp_path):
    missing = str(tmp_path / "no-venv" / "python")
    flags = [f"--{k}-python={missing}" for k in ("genai", "ov", "llamacpp")]
    p = subprocess.run(
        [sys.executable, str(BENCH / "bench_llm.py"), "--model", "small256", "--list", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "small256: hidden 256, 4 layers, 4/2 heads, vocab 32000"
    assert lines[1] == "would run: precast-fp32, precast-int4, precast-ov-fp32, precast-ov-bf16, precast-ov-int4"
    skipped = [ln.split(":")[0] for ln in lines[2:]]
    assert skipped == [
        "genai-fp32",
        "genai-int4",
        "ov-fp32",
        "ov-fp32-f32",
        "ov-int4",
        "llamacpp-f32",
        "llamacpp-q4_0",
    ]
    assert all(ln.endswith(f"skipped: {missing} not found") for ln in lines[2:])


def test_bench_llm_refuses_an_unknown_engine():
    p = subprocess.run(
        [sys.executable, str(BENCH / "bench_llm.py"), "--engines", "precast-fp32,ov-fp16", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "unknown engine 'ov-fp16'" in p.stderr
