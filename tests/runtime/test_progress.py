"""precast.runtime.progress: the reporter protocol the compiler and runtime call; perplexity reports per window."""

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.runtime.llm.perplexity import make_windows, score_windows
from precast.runtime.progress import (
    SILENT,
    CallbackProgress,
    ProgressReporter,
    reporter,
)
from tests.fake_progress import RecordingProgress


def test_reporter_adapts_none_callables_and_reporters():
    assert reporter(None) is SILENT
    rec = RecordingProgress()
    assert reporter(rec) is rec and isinstance(rec, ProgressReporter)
    said = []
    old = reporter(said.append)  # the older one-message API: steps and notes, no advances
    assert isinstance(old, CallbackProgress)
    old.step("exporting")
    old.advance(1, 3, "layer 1")
    old.note("fused=2")
    old.done()
    assert said == ["exporting", "fused=2"]


def test_progress_module_is_standard_library_only():
    """The runtime and the compiler both import it; the CLI's rich drawing stays in cli/output.py."""
    import precast.runtime.progress as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


@dataclass(frozen=True)
class _Spec:
    max_context: int = 64
    block_size: int = 4
    vocab: int = 16

    def blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)


class _Runner:
    """Random logits of the step contract's shape: enough to drive score_windows."""

    def __init__(self, num_blocks: int = 64):
        self.spec, self.num_blocks, self.steps = _Spec(), num_blocks, 0
        self.rng = np.random.default_rng(0)

    def step(self, ids, positions, past_lens, new_lens, tables):
        self.steps += 1
        return self.rng.standard_normal((len(ids), self.spec.vocab)).astype(np.float32)


def test_perplexity_reports_each_step_naming_its_windows():
    tokens = np.arange(40) % 16
    windows = make_windows(len(tokens), 16, 8)  # overlapping: context prefill, then decode steps
    runner, rec = _Runner(), RecordingProgress()
    score_windows(runner, tokens, windows, batch=2, progress=rec)
    got = rec.advances()
    assert len(got) == runner.steps and [d for d, _, _ in got] == list(range(1, runner.steps + 1))
    assert {t for _, t, _ in got} == {runner.steps}  # the total is known up front and exact
    labels = list(dict.fromkeys(w for _, _, w in got))
    n = len(windows)
    assert labels == [f"windows {g + 1}-{min(g + 2, n)} of {n}" if g + 1 < n else f"window {n} of {n}"
                      for g in range(0, n, 2)]  # fmt: skip
