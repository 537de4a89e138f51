"""LLM engine decode speed and the per-step cost outside the model run (scheduler + engine + sampler).

    python benchmarks/bench_llm_overhead.py [--artifact DIR] [--rounds 5] [--threads 2] [--json]
    python benchmarks/with_precast.py /tmp/oldpkg benchmarks/bench_llm_overhead.py --json   # an older tree

Model: bench_llm.py's Llama-style decoder (fp32, built into --work when --artifact is not given).
Per round: batch 1 (prompt 128 + 128 new, token ids only) and 8 such requests at once.
  b1 tok/s     decode tokens/s of the single request (time to first token excluded)
  b8 tok/s     aggregate tokens/s of the 8 requests (whole generation, prefill included)
  host us      per decode step: the engine loop's step wall time minus the time inside the ONNX Runtime call
               (session.run / run_with_iobinding), median over the round's decode steps, b1 and b8
  engine us    per decode step with a runner that costs nothing (fixed logits, vocab 32000): scheduler +
               engine + sampler alone, the best of 25 generations' medians, b1 and b8 (no model needed:
               the stable number on a busy host, where "host us" also holds the runner and the scheduling
               delays of a loaded machine)
Medians over rounds. Run two trees alternately (with_precast.py) and compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT, NEW, BATCH = 128, 128, 8


class _Clock:
    seconds = 0.0


class _TimedSession:
    """The runner's session with the time spent inside its run calls added up (into ``clock.seconds``:
    one clock for both sessions of a spin switch)."""

    def __init__(self, inner, clock: _Clock | None = None):
        self._inner, self._clock = inner, clock if clock is not None else _Clock()
        if "_sess" in getattr(inner, "__dict__", {}):  # ORT's C++ session, which the mapped runner calls
            self._sess = _TimedC(inner._sess, self)

    @property
    def seconds(self) -> float:
        return self._clock.seconds

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - t0

    def run(self, *args, **kwargs):
        return self._timed(self._inner.run, *args, **kwargs)

    def run_with_iobinding(self, *args, **kwargs):
        return self._timed(self._inner.run_with_iobinding, *args, **kwargs)


class _TimedC:
    """ORT's C++ session (InferenceSession._sess) with its run_with_iobinding timed into ``owner.seconds``."""

    def __init__(self, inner, owner: _TimedSession):
        self._inner, self._owner = inner, owner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def run_with_iobinding(self, *args):
        return self._owner._timed(self._inner.run_with_iobinding, *args)


class _FreeRunner:
    """A runner whose steps cost nothing: the same logits every step (greedy picks from them)."""

    def __init__(self, vocab: int = 32000, block_size: int = 16, num_blocks: int = 272):
        self.spec = SimpleNamespace(vocab=vocab, block_size=block_size, max_context=512, eos_ids=(), pad_id=0)
        self.key_cache = self.value_cache = [np.zeros((num_blocks, 1, block_size, 1), np.float32)]
        self.num_blocks, self.kv_bytes, self.kv_resident_bytes = num_blocks, 0, 0  # (runner.StepRunner)
        self._logits = np.random.default_rng(0).standard_normal((BATCH, vocab)).astype(np.float32)

    def execute(self, out):
        return self._logits[: len(out.rows)]

    # (the entry points engines before issue 16.3 called, so that an older tree is timed the same way)
    def step_unchecked(self, ids, *rest):
        return self._logits[: ids.shape[0]]

    def decode_unchecked(self, tokens, *rest):
        return self._logits[: len(tokens)]

    step, decode_again = step_unchecked, decode_unchecked

    def shutdown(self) -> None:  # (runner.StepRunner: no threads)
        pass

    def single_decoder(self):  # (the engine's batch-1 burst: the same fixed logits, token after token)
        row = self._logits[0]
        return lambda token, position: row


def stepper(engine):
    """The engine's own loop step (with the batch-1 burst, where the tree has one) -> tokens produced."""
    inner = getattr(engine, "_step", None)
    return engine.step if inner is None else (lambda: inner(burst=True))


def engine_only_us(batch: int, runs: int = 25) -> float:
    from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

    best = float("inf")
    for _ in range(runs + 1):
        engine = Engine(_FreeRunner(), None, config=SchedulerConfig(512), enable_prefix_caching=False)
        params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)
        handles = [engine.submit(list(range(5, 5 + PROMPT)), params) for _ in range(batch)]
        times, step = [], stepper(engine)
        while engine.has_unfinished():
            decoding = all(h.token_ids for h in handles)
            t0 = time.perf_counter()
            steps = max(1, step() // batch)  # (a batch-1 burst runs several steps in one call)
            if decoding:
                times.extend([(time.perf_counter() - t0) / steps] * steps)
        best = min(best, statistics.median(times))
    return 1e6 * best


def generate(engine, session: _TimedSession, prompts, params) -> tuple[float, float, list[float]]:
    """(wall s, first-token s, host seconds of each step after every request has its first token)."""
    t0 = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    first, host, step, batch = None, [], stepper(engine), len(prompts)
    while engine.has_unfinished():
        decoding = all(h.token_ids for h in handles)
        ort0, s0 = session.seconds, time.perf_counter()
        steps = max(1, step() // batch)  # (a batch-1 burst runs several steps in one call)
        wall = time.perf_counter() - s0
        if decoding:
            host.extend([(wall - (session.seconds - ort0)) / steps] * steps)
        if first is None and all(h.token_ids for h in handles):
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert all(len(h.result().token_ids) == NEW for h in handles)
    return total, first, host


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, default=None)
    ap.add_argument("--work", default="/tmp/precast-bench-llm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args(argv)

    from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig

    art = args.artifact
    if art is None:
        from bench_llm import build

        art = build(Path(args.work), int4=False)["precast-fp32"]
    engine = Engine.load(
        art,
        num_blocks=2 * BATCH * (PROMPT + NEW) // 16 + 16,
        threads=args.threads,
        config=SchedulerConfig(max_num_batched_tokens=512),
        enable_prefix_caching=False,
    )
    runner = engine.runner
    session = runner._session = _TimedSession(runner._session)
    switch = runner.spin_switch  # (spinning="auto": the steps run on its calm or spinning session)
    if switch is not None:
        switch.calm = runner._session
        switch.spinning = _TimedSession(switch.spinning, session._clock)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 500, PROMPT).tolist() for _ in range(BATCH)]
    generate(engine, session, prompts[:1], params)  # warm-up (bindings, caches)
    generate(engine, session, prompts, params)
    b1, b8, host1, host8 = [], [], [], []
    for _ in range(args.rounds):
        wall, first, host = generate(engine, session, prompts[:1], params)
        b1.append((NEW - 1) / (wall - first))
        host1.append(statistics.median(host))
        wall, _, host = generate(engine, session, prompts, params)
        b8.append(BATCH * NEW / wall)
        host8.append(statistics.median(host))
    row = {
        "b1_tok_s": statistics.median(b1),
        "b8_tok_s": statistics.median(b8),
        "host_us_b1": 1e6 * statistics.median(host1),
        "host_us_b8": 1e6 * statistics.median(host8),
        "engine_us_b1": engine_only_us(1),
        "engine_us_b8": engine_only_us(BATCH),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(row))
        return
    names = ("b1 tok/s", "b8 tok/s", "host us b1", "host us b8", "engine us b1", "engine us b8")
    print(" ".join(f"{n:>12}" for n in names) + f"  ({args.rounds} rounds)")
    print(" ".join(f"{v:12.1f}" for k, v in row.items() if k != "rounds"))


if __name__ == "__main__":
    main()
