"""``precast bench``: latency and throughput of an artifact at several concurrency levels (trtexec /
perf_analyzer for precast artifacts).

    report = bench("out/minilm", BenchOptions(concurrency=(1, 4), duration_s=5, dims={"batch": 1}))
    report.levels[0].latency.p50_ms, report.levels[0].requests_per_s

At each concurrency N, N clients issue requests back to back (a closed loop: each sends its next request as
soon as the last one finished) for ``duration_s`` seconds or ``requests`` requests, after an unmeasured
warm-up of the same shape. Every client finishes at least one request. The numbers are computed as
benchmarks/ computes them: percentiles by numpy's linear interpolation, throughput = finished requests over the
window from the first request sent to the last one finished.

- A plain artifact runs in this process: N threads call ``Model.run`` on one session (ONNX Runtime sessions
  are thread-safe; concurrent runs share its intra-op threads) with feeds generated from the IO signature
  (runtime/bench/inputs.py), or given ones.
- A causal-lm artifact runs on the LLM engine (runtime/bench/llm.py): N requests in flight, continuous
  batching, ``prompt_len`` random token ids in and exactly ``output_len`` tokens out (EOS ignored); TTFT,
  inter-token latency and tokens/s.
- With ``url``, the same requests go to a running ``precast serve`` on this host (runtime/bench/http.py):
  KServe v2 infer or /v1/embeddings, or streamed /v1/completions for an LLM.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from precast.artifact.manifest import Manifest, TensorSpec, read_manifest
from precast.artifact.target_blocks import OrtBlock
from precast.errors import PrecastError, UsageError, first_line
from precast.runtime.bench.inputs import (
    FeedHints,
    InputInfo,
    generate_feeds,
    leading_batch,
    resolve_dims,
)
from precast.runtime.bench.report import (
    BenchReport,
    Host,
    Level,
    Sample,
    level_from_samples,
)

if TYPE_CHECKING:
    from precast.runtime.llm.speculative import SpeculativeConfig

__all__ = [
    "BenchOptions",
    "BenchReport",
    "ENDPOINTS",
    "MAX_CONCURRENCY",
    "Level",
    "bench",
    "closed_loop",
    "parse_concurrency",
    "parse_duration",
]

MAX_CONCURRENCY = 1024
ENDPOINTS = ("auto", "v2", "embeddings", "completions")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchOptions:
    concurrency: tuple[int, ...] = (1,)
    duration_s: float | None = 10.0  # per level; None when ``requests`` is given
    requests: int | None = None  # per level, shared by its clients
    warmup_s: float = 1.0  # per level, unmeasured (each client still runs one request); 0 = none
    dims: Mapping[str, int] = field(default_factory=dict)
    feeds: Mapping[str, np.ndarray] | None = None  # instead of generated feeds
    threads: int | None = None  # intra-op threads (None: the artifact's setting)
    prefer: str | None = None  # target of a multi-target artifact
    seed: int = 0
    # causal-lm artifacts
    prompt_len: int = 128
    output_len: int = 128
    shared_prefix: bool = False  # every request the same prompt (prefix cache on); default: fresh prompts
    num_blocks: int | None = None  # KV pool (default: room for every request of the largest level)
    speculative: SpeculativeConfig | None = None  # speculative decoding of the in-process engine
    # a running `precast serve`
    url: str | None = None
    model_name: str | None = None  # default: the one the server lists
    endpoint: str = "auto"  # auto | v2 | embeddings | completions
    timeout_s: float = 300.0  # one HTTP request

    def check(self) -> None:
        """UsageError naming the first bad option, before anything is loaded."""
        if not self.concurrency or any(
            isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONCURRENCY
            for c in self.concurrency
        ):
            raise UsageError(
                f"concurrency levels must be integers in 1..{MAX_CONCURRENCY}, got {self.concurrency!r}"
            )
        if (self.duration_s is None) == (self.requests is None):
            raise UsageError("give a duration or a number of requests per level, not both")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise UsageError(f"duration must be a positive number of seconds, got {self.duration_s!r}")
        if self.requests is not None and (isinstance(self.requests, bool) or self.requests < 1):
            raise UsageError(f"--requests must be a positive integer, got {self.requests!r}")
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise UsageError(f"warm-up must be >= 0 seconds, got {self.warmup_s!r}")
        for name in ("prompt_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.endpoint not in ENDPOINTS:
            raise UsageError(f"unknown endpoint '{self.endpoint}' (one of {', '.join(ENDPOINTS)})")
        if self.dims and self.feeds is not None:
            raise UsageError("--dim sizes generated feeds; with --input the feeds' own shapes are used")
        if self.url is not None and self.threads is not None:
            raise UsageError(
                "--threads sets in-process threads; with --url the server's are its own (serve --threads)"
            )
        if self.url is not None and self.num_blocks is not None:
            raise UsageError(
                "--num-blocks sizes the in-process KV pool; with --url it is the server's (serve --num-blocks)"
            )
        if self.url is not None and self.speculative is not None:
            raise UsageError(
                "--draft / --speculative set up the in-process engine; with --url the server's own flags decide "
                "(serve --draft ...)"
            )
        if self.url is None and (self.model_name is not None or self.endpoint != "auto"):
            raise UsageError("--model-name and --endpoint choose what a server is sent; they need --url")
        if not (self.timeout_s > 0):
            raise UsageError(f"timeout must be > 0 seconds, got {self.timeout_s!r}")


_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, option: str = "--duration", *, allow_zero: bool = False) -> float:
    """'30s', '2m', '500ms', '1.5', '1h' -> seconds (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", str(text).lower())
    if m is None or m.group(2) not in ("", *_UNITS):
        raise UsageError(f"bad {option} '{text}': expected a number with a unit, e.g. 30s, 2m, 500ms")
    seconds = float(m.group(1)) * _UNITS.get(m.group(2), 1.0)
    if seconds <= 0 and not (allow_zero and seconds == 0):
        raise UsageError(f"bad {option} '{text}': must be more than 0")
    return seconds


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16): positive integers up to MAX_CONCURRENCY, each once, in the given order."""
    out: list[int] = []
    for part in str(text).split(","):
        p = part.strip()
        if not p.isdigit() or not 1 <= int(p) <= MAX_CONCURRENCY:
            raise UsageError(
                f"bad --concurrency '{text}': expected comma-separated integers in 1..{MAX_CONCURRENCY}, e.g. 1,4,16"
            )
        if int(p) not in out:
            out.append(int(p))
    return tuple(out)


# -- the closed loop -------------------------------------------------------------------------------------
class RequestFailed(Exception):
    """One request failed the way a busy server fails it (an HTTP error status): counted, the client goes on.
    Any other exception stops its client; the level reports the first error either way."""


def closed_loop(
    clients: Sequence[Callable[[], Sequence[float] | None]],
    *,
    duration_s: float | None,
    requests: int | None,
) -> tuple[list[Sample], int, str | None, float]:
    """Run each client callable on its own thread, back to back, until ``duration_s`` has passed since the
    common start (each client finishes at least one request) or ``requests`` requests were taken in all.

    A client returns None, or the times its request's tokens arrived. Returns (samples, errors, first error
    message, start time)."""
    n = len(clients)
    start: list[float] = []
    barrier = threading.Barrier(n, action=lambda: start.append(time.perf_counter()))
    lock = threading.Lock()
    taken = [0]
    results: list[list[Sample]] = [[] for _ in range(n)]
    errors = [0]
    first: list[str] = []

    def take() -> bool:
        with lock:
            if taken[0] >= (requests or 0):
                return False
            taken[0] += 1
            return True

    def fail(msg: str) -> None:
        with lock:
            errors[0] += 1
            if not first:
                first.append(msg)

    def worker(i: int) -> None:
        call, mine = clients[i], results[i]
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return
        deadline = start[0] + (duration_s or 0.0)
        ended = None  # when this client's last request ended: it stops at the first to end past the deadline
        while True:
            if requests is not None:
                if not take():
                    return
            elif ended is not None and ended >= deadline:
                return
            t0 = time.perf_counter()
            try:
                tokens = call()
            except RequestFailed as e:
                ended = time.perf_counter()
                fail(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - reported as the level's first error, this client stops
                fail(str(e) if isinstance(e, PrecastError) else first_line(e, with_type=True))
                return
            ended = time.perf_counter()
            mine.append(Sample(t0, ended, tokens))

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"precast-bench-{i}", daemon=True) for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = sorted((s for r in results for s in r), key=lambda s: s.start)
    return samples, errors[0], first[0] if first else None, start[0] if start else time.perf_counter()


def _checked_level(level: Level) -> Level:
    if level.requests == 0:
        raise UsageError(
            f"every request at concurrency {level.concurrency} failed: {level.first_error or 'no request finished'}"
        )
    return level


# -- artifacts -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _artifact_dir(path: str | os.PathLike) -> Iterator[Path]:
    """The artifact as a directory: a packed file is unpacked (every checksum checked) into a temp dir, for as
    long as the bench runs."""
    root = Path(path)
    if not root.is_file():
        yield root
        return
    from precast.artifact.archive import remove_temp, unpack_to_temp

    tmp = unpack_to_temp(root)
    try:
        yield tmp
    finally:
        remove_temp(tmp)


def _served_dir(root: Path, manifest: Manifest, prefer: str | None) -> tuple[Path, Manifest]:
    """The (sub-)artifact whose signature a bench uses without loading it (http mode): a multi-target
    artifact's best target in the runtime's order, as the server picks it when this host can run it."""
    if not manifest.is_multi_target:
        return root, manifest
    from precast.artifact.manifest import artifact_path
    from precast.runtime.model import preference_order

    entries = manifest.target_dirs()
    if prefer is not None and prefer not in entries:
        raise UsageError(f"{root}: no target '{prefer}' in this artifact (has: {', '.join(sorted(entries))})")
    name = preference_order(entries, prefer)[0]
    sub = artifact_path(root, entries[name], f"targets.{name}.dir")
    return sub, read_manifest(sub)


def _threads_words(manifest: Manifest, threads: int | None) -> str:
    """Intra-op threads in words: the given count, the artifact's stored one, or ONNX Runtime's default."""
    if threads is not None:
        return str(threads)
    target = manifest.target
    stored = target.session_settings.intra_op_num_threads if isinstance(target, OrtBlock) else None
    return f"{stored} (artifact setting)" if stored else "ORT default"


def bench(path: str | os.PathLike, options: BenchOptions, progress: Progress | None = None) -> BenchReport:
    """Benchmark the artifact at ``path`` at each of ``options.concurrency``; see the module docstring."""
    options.check()
    say = progress or (lambda _msg: None)
    url = None
    if options.url is not None:
        from precast.runtime.bench.http import loopback_url

        url = loopback_url(options.url)  # a non-loopback address fails before the artifact is read
    with _artifact_dir(path) as root:
        top = read_manifest(root)
        if top.is_multi_target:  # a causal LM's index: the target its loaders would open at this load
            from precast.runtime.llm.engine import llm_index_target

            sub = llm_index_target(
                root,
                options.prefer,
                concurrency=max(options.concurrency),
                speculative=options.speculative is not None,
            )
            if sub is not None:
                root, top = sub, read_manifest(sub)
        if top.llm is not None:
            if options.dims or options.feeds is not None:
                raise UsageError(
                    f"{path} is a causal-lm artifact: --dim and --input do not apply; use --prompt-len / --output-len"
                )
            from precast.runtime.bench.llm import bench_llm

            report = bench_llm(root, top, options, url, say)
        else:
            if options.speculative is not None:
                raise UsageError(
                    f"{path} is not a causal-lm artifact: --draft / --speculative apply to LLMs only"
                )
            report = _bench_model(root, top, options, url, say)
    host = replace(report.host, load_end=Host.now().load_start)
    return replace(report, artifact=str(path), host=host)


def _bench_model(
    root: Path, top: Manifest, options: BenchOptions, url: str | None, say: Progress
) -> BenchReport:
    host = Host.now()
    with contextlib.ExitStack() as stack:
        if url is None:
            from precast.runtime.model import load

            model = load(root, threads=options.threads, prefer=options.prefer)
            sub, manifest, specs, target = model.path, model.manifest, list(model.inputs), model.target
        else:
            sub, manifest = _served_dir(root, top, options.prefer)
            specs, target = list(manifest.io.inputs), manifest.target.name
        feeds, infos, dims, defaulted = _feeds(sub, manifest, specs, options)
        items = leading_batch(specs, dims)
        endpoint = model_name = None
        if url is None:
            model.run(feeds)  # a feed the model rejects fails here, in the backend's words, before any level
            say(f"in-process, target {target}, {_threads_words(manifest, options.threads)} intra-op threads")

            def make_client(_i: int):
                def call() -> None:
                    model.run(feeds)

                return call
        else:
            from precast.runtime.bench.http import HttpClients, model_clients

            http = stack.enter_context(HttpClients(url, options.timeout_s))
            endpoint, model_name, make_client, items = model_clients(
                http, sub, specs, feeds, dims, items, options
            )
            say(f"{url} serving '{model_name}', {endpoint} requests")
        levels = [_run_level(c, make_client, options, items, say) for c in options.concurrency]
    return BenchReport.of_run(
        options,
        root,
        url,
        host,
        levels,
        kind="model",
        target=target,
        threads=_threads_words(manifest, options.threads) if url is None else "the server's",
        endpoint=endpoint,
        model_name=model_name,
        dims=dims,
        defaulted_dims=defaulted,
        inputs=infos,
        items_per_request=items,
    )


def _feeds(
    root: Path, manifest: Manifest, specs: list[TensorSpec], options: BenchOptions
) -> tuple[dict[str, np.ndarray], list[InputInfo], dict[str, int], list[str]]:
    if options.feeds is not None:
        from precast.runtime.bench.inputs import dim_key
        from precast.runtime.feeds import check_feeds

        feeds = check_feeds(options.feeds, specs)
        dims = {
            dim_key(s, i): int(feeds[s.name].shape[i])
            for s in specs
            for i, d in enumerate(s.shape or ())
            if not isinstance(d, int)
        }
        infos = [InputInfo(s.name, s.dtype, list(feeds[s.name].shape), "given (--input)") for s in specs]
        return feeds, infos, dims, []
    dims, defaulted = resolve_dims(specs, options.dims)
    feeds, infos = generate_feeds(specs, dims, FeedHints.from_artifact(root, manifest), seed=options.seed)
    return feeds, infos, dims, defaulted


def _run_level(c: int, make_client, options: BenchOptions, items: int, say: Progress) -> Level:
    if options.warmup_s > 0:
        closed_loop([make_client(i) for i in range(c)], duration_s=options.warmup_s, requests=None)
    window = f"{options.duration_s:g} s" if options.requests is None else f"{options.requests} requests"
    say(f"concurrency {c}: {window}")
    samples, errors, first, t0 = closed_loop(
        [make_client(i) for i in range(c)], duration_s=options.duration_s, requests=options.requests
    )
    return _checked_level(level_from_samples(c, samples, errors, first, t0, items))
