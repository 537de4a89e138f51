"""Serve precast `triton`-target artifacts with the real tritonserver and check its answers.

Runs inside the Triton virtualenv (scripts/triton_smoke.sh makes it): nvidia-pytriton (which bundles
tritonserver with the Python backend only), tritonclient[http], and precast's runtime. It validates every
artifact's config.pbtxt files against Triton's ModelConfig protobuf, starts one tritonserver on loopback
over all the artifacts' model repositories (each artifact's Python-backend model; a staged artifact's
ensemble and its stage models), sends real requests and compares them with precast.runtime run locally
(tensor models and ensembles: parity sample, concurrent requests of mixed batch sizes, a bad request;
LLMs: greedy streams over /generate_stream == precast Engine). A staged artifact served beside an unsplit
one of the same source must answer the same requests as it. Then it stops the server (SIGTERM, then
SIGKILL of its process group) whatever happened.

    python scripts/triton_smoke.py ARTIFACT [ARTIFACT ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

READY_TIMEOUT_S = 90.0


def _log(msg: str) -> None:
    print(f"[triton-smoke] {msg}", flush=True)


def validate_configs(repo: Path) -> list[str]:
    """Parse every config.pbtxt with Triton's own ModelConfig message (unknown fields fail)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    names = []
    for cfg in sorted(repo.glob("*/config.pbtxt")):
        msg = text_format.Parse(cfg.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
        assert msg.name == cfg.parent.name, f"{cfg}: name '{msg.name}' != folder '{cfg.parent.name}'"
        names.append(msg.name)
    return names


def triton_install(work: Path) -> tuple[Path, Path, dict]:
    """tritonserver binary, backend dir (with the stub for this Python) and the env to run it with."""
    import pytriton
    from pytriton.utils.distribution import get_libs_path, get_stub_path

    dist = Path(pytriton.__file__).parent / "tritonserver"
    backends = work / "backends"
    shutil.copytree(dist / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    shutil.copy(get_stub_path(version), backends / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(get_libs_path()), env.get("LD_LIBRARY_PATH")) if p)
    # The stub embeds the first python3 on PATH: this venv's, where precast.runtime is installed.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return dist / "bin" / "tritonserver", backends, env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGKILL it when this driver dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


class Server:
    def __init__(
        self, binary: Path, backends: Path, env: dict, repos: list[Path], models: list[str], work: Path
    ):
        self.port = free_port()
        self.shm_prefix = f"precast-smoke-{os.getpid()}-{self.port}"
        self.log_path = work / "tritonserver.log"
        cmd = [
            str(binary),
            *(f"--model-repository={repo}" for repo in repos),
            "--model-control-mode=explicit",
            *(f"--load-model={model}" for model in models),
            f"--backend-directory={backends}",
            f"--cache-directory={work}",
            "--http-address=127.0.0.1",
            f"--http-port={self.port}",
            "--allow-grpc=false",
            "--allow-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--exit-timeout-secs=5",
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the server runs
        # cwd: not the repo root, whose precast/ folder would shadow the installed package in the stub.
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run yet
            cwd=work,
        )
        self.url = f"127.0.0.1:{self.port}"

    def wait_ready(self, models: list[str]) -> None:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(Exception):  # not listening yet
                if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"tritonserver not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM the server's process group (server + Python stubs); SIGKILL what is left after 15 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stubs that outlived the server
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)


# -- checks -----------------------------------------------------------------------------------------
def _infer(client, model: str, feeds: dict, output_names: list[str]) -> dict:
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in feeds.items():
        t = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr, binary_data=True)
        inputs.append(t)
    outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in output_names]
    result = client.infer(model, inputs, outputs=outs)
    return {n: result.as_numpy(n) for n in output_names}


def check_tensor_model(url: str, model: str, artifact: Path, manifest: dict) -> dict:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from precast.runtime import load

    local = load(artifact)
    out_names = [o.name for o in local.outputs]
    parity = manifest["parity"]
    tol = parity["tolerance"]
    atol, rtol = tol.get("atol") or 1e-4, tol.get("rtol") or 1e-3
    client = httpclient.InferenceServerClient(url)

    # 1. The compile's own sample: Triton's answer == the expected outputs stored in the artifact.
    feeds = {n: np.load(artifact / rel, allow_pickle=False) for n, rel in parity["inputs"].items()}
    got = _infer(client, model, feeds, out_names)
    worst = 0.0
    for n, rel in parity["expected"].items():
        exp = np.load(artifact / rel, allow_pickle=False)
        np.testing.assert_allclose(
            got[n], exp, rtol=rtol, atol=atol, err_msg=f"output '{n}' vs parity/expected"
        )
        worst = max(worst, float(np.max(np.abs(got[n].astype(np.float64) - exp))) if exp.size else 0.0)
    _log(f"{model}: parity sample ok (max abs error {worst:.2e})")

    # 2. Concurrent requests of mixed batch sizes (the dynamic batcher stacks them): each == local run.
    block = manifest["target"]["triton"]
    sample = {n: np.load(artifact / rel, allow_pickle=False) for n, rel in parity["inputs"].items()}
    n_requests = 24
    requests = make_requests(sample, block["batch_dim"], n_requests, seed=0)
    for req, got in zip(requests, infer_concurrently(url, model, requests, out_names)):
        exp = local.run(req)
        for n in out_names:
            np.testing.assert_allclose(
                got[n], exp[n], rtol=rtol, atol=atol, err_msg=f"concurrent request, output '{n}'"
            )
    stats = client.get_inference_statistics(model)["model_stats"][0]
    # An ensemble's stage models keep their own counts (each stage's dynamic batcher stacks requests).
    stages = {m: _counts(client, m) for m in block.get("stage_models", ())}
    _log(
        f"{model}: {n_requests} concurrent requests ok; inference_count={stats['inference_count']} "
        f"execution_count={stats['execution_count']}"
        + "".join(f"; {m}: {c['inference_count']}/{c['execution_count']}" for m, c in stages.items())
    )

    # 3. A bad request gets an error naming the input; the server keeps serving.
    name, arr = next(iter(sample.items()))
    shape = next(i for i in manifest["io"]["inputs"] if i["name"] == name).get("shape") or [None]
    if isinstance(shape[-1], int):  # a fixed last dim: one of another size
        bad_arr, what = np.zeros((*arr.shape[:-1], arr.shape[-1] + 3), dtype=arr.dtype), "shape"
    else:  # a variable one (a sequence) takes any size: another dtype
        bad_arr, what = arr.astype(np.float32 if arr.dtype != np.float32 else np.float64), "dtype"
    bad = {**sample, name: bad_arr}
    try:
        _infer(client, model, bad, out_names)
        raise AssertionError(f"a request with a wrong {what} was accepted")
    except InferenceServerException as e:
        assert name in str(e), f"error does not name input '{name}': {e}"
        _log(f"{model}: bad {what} rejected: {str(e).splitlines()[0][:160]}")
    np.testing.assert_allclose(
        _infer(client, model, feeds, out_names)[out_names[0]],
        np.load(artifact / parity["expected"][out_names[0]], allow_pickle=False),
        rtol=rtol,
        atol=atol,
    )
    return {
        "max_abs_error": worst,
        "requests": n_requests + 3,
        "inference_count": stats["inference_count"],
        "execution_count": stats["execution_count"],
        **({"stages": stages} if stages else {}),
    }


def make_requests(sample: dict, batch_dim: str | None, n: int, seed: int) -> list[dict]:
    """``n`` requests shaped like the parity sample: 1-3 rows when the model has a batch dim; random floats,
    the sample's own integers (ids, masks) repeated."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        rows = 1 + i % 3 if batch_dim else None
        req = {}
        for name, arr in sample.items():
            shape = (rows, *arr.shape[1:]) if rows else arr.shape
            req[name] = (
                rng.standard_normal(shape).astype(arr.dtype)
                if arr.dtype.kind == "f"
                else np.resize(arr, shape).astype(arr.dtype)
            )
        requests.append(req)
    return requests


def infer_concurrently(url: str, model: str, requests: list[dict], out_names: list[str]) -> list[dict]:
    import tritonclient.http as httpclient

    with ThreadPoolExecutor(8) as pool:
        return list(
            pool.map(
                lambda req: _infer(httpclient.InferenceServerClient(url), model, req, out_names), requests
            )
        )


def _counts(client, model: str) -> dict:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {"inference_count": stats["inference_count"], "execution_count": stats["execution_count"]}


def check_same_answers(url: str, staged: str, unsplit: str, artifact: Path, manifest: dict) -> dict:
    """The ensemble of a staged artifact and the unsplit model of the same source, served side by side,
    answer the same concurrent requests alike (fp32: the same kernels on the same rows, cut in two)."""
    parity = manifest["parity"]
    sample = {n: np.load(artifact / rel, allow_pickle=False) for n, rel in parity["inputs"].items()}
    out_names = [o["name"] for o in manifest["io"]["outputs"]]
    requests = make_requests(sample, manifest["target"]["triton"]["batch_dim"], 12, seed=1)
    a = infer_concurrently(url, staged, requests, out_names)
    b = infer_concurrently(url, unsplit, requests, out_names)
    worst = 0.0
    for got, exp in zip(a, b):
        for n in out_names:
            np.testing.assert_allclose(
                got[n],
                exp[n],
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"ensemble '{staged}' vs '{unsplit}', output '{n}'",
            )
            worst = max(
                worst, float(np.max(np.abs(got[n].astype(np.float64) - exp[n]))) if exp[n].size else 0.0
            )
    _log(
        f"{staged} (ensemble) == {unsplit} (unsplit) on {len(requests)} concurrent requests (max abs diff {worst:.2e})"
    )
    return {"unsplit": unsplit, "requests": len(requests), "max_abs_diff": worst}


def _generate_stream(url: str, model: str, body: dict) -> tuple[str, list[int], str | None]:
    req = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    text, ids, reason = [], [], None
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:  # Triton answers a rejected request with 400 and a JSON error
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"generate_stream error: {event['error']}")
            text.append(event["text_output"])
            ids.append(int(event["token_id"]))
            reason = event.get("finish_reason", reason)
    return "".join(text), ids, reason


def check_llm_model(url: str, model: str, artifact: Path) -> dict:
    from precast.runtime.llm import Engine, SamplingParams

    prompts = ["def main(", "import os\n", "class Text"]
    engine = Engine.load(artifact)
    expected = engine.generate(prompts, SamplingParams(max_tokens=8))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(
            pool.map(lambda p: _generate_stream(url, model, {"text_input": p, "max_tokens": 8}), prompts)
        )
    seconds = time.perf_counter() - t0
    for p, exp, (text, ids, reason) in zip(prompts, expected, got):
        assert ids == exp.token_ids, f"prompt {p!r}: Triton tokens {ids} != precast Engine {exp.token_ids}"
        assert text == exp.text, f"prompt {p!r}: Triton text {text!r} != precast Engine {exp.text!r}"
        assert reason == exp.finish_reason, f"prompt {p!r}: finish_reason {reason!r} != {exp.finish_reason!r}"
    _log(
        f"{model}: {len(prompts)} concurrent greedy streams == precast Engine ({sum(len(g[1]) for g in got)} tokens, "
        f"{seconds:.2f} s)"
    )
    try:
        _generate_stream(url, model, {"text_input": "x", "max_tokens": -1})
        raise AssertionError("max_tokens=-1 was accepted")
    except RuntimeError as e:
        assert "max_tokens" in str(e), f"error does not name max_tokens: {e}"
        _log(f"{model}: bad max_tokens rejected: {str(e)[:160]}")
    return {"streams": len(prompts), "tokens": sum(len(g[1]) for g in got), "seconds": round(seconds, 3)}


def check_same_streams(url: str, staged: str, unsplit: str) -> dict:
    """A staged LLM artifact's model and the unsplit one of the same source stream the same greedy tokens."""
    prompts = ["def main(", "import os\n", "class Text"]
    body = lambda p: {"text_input": p, "max_tokens": 8}  # noqa: E731
    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        a = list(pool.map(lambda p: _generate_stream(url, staged, body(p)), prompts))
        b = list(pool.map(lambda p: _generate_stream(url, unsplit, body(p)), prompts))
    for p, (_, ids_a, _), (_, ids_b, _) in zip(prompts, a, b):
        assert ids_a == ids_b, f"prompt {p!r}: '{staged}' streamed {ids_a}, '{unsplit}' {ids_b}"
    _log(f"{staged} (staged) == {unsplit} (unsplit): {len(prompts)} concurrent greedy streams")
    return {"unsplit": unsplit, "streams": len(prompts), "tokens": sum(len(x[1]) for x in a)}


class Served:
    """One artifact's part of the server: its manifest, the models to load and the one clients call."""

    def __init__(self, artifact: Path):
        self.artifact = artifact
        self.manifest = json.loads((artifact / "manifest.json").read_text())
        self.block = self.manifest["target"].get("triton")
        if not self.block:
            raise SystemExit(f"{artifact}: not a 'triton' target artifact")
        self.repo = artifact / self.block["repository"]
        self.staged = self.manifest.get("stages") is not None  # split-stages: an ensemble, or a staged engine
        ensemble = self.block.get("ensemble")
        self.model = ensemble or self.block["python_model"]
        self.models = [*self.block["stage_models"], ensemble] if ensemble else [self.model]


def smoke(artifacts: list[Path], work: Path) -> list[dict]:
    """All artifacts in one tritonserver (one start: each start costs seconds of stub spawns)."""
    served = [Served(a) for a in artifacts]
    for s in served:
        models = validate_configs(s.repo)
        _log(f"{s.artifact.name}: config.pbtxt parsed by Triton's ModelConfig protobuf: {', '.join(models)}")
    names = [m for s in served for m in s.models]
    if len(set(names)) != len(names):
        raise SystemExit(f"two artifacts serve a model of the same name: {names}")
    binary, backends, env = triton_install(work / "tritonserver")
    server = Server(binary, backends, env, [s.repo for s in served], names, work)
    results = []
    try:
        t0 = time.perf_counter()
        server.wait_ready(names)
        _log(
            f"tritonserver ready on {server.url} with {len(names)} models in {time.perf_counter() - t0:.1f} s"
        )
        for s in served:
            if s.block["mode"] == "llm":
                result = {"model": s.model, **check_llm_model(server.url, s.model, s.artifact)}
            else:
                result = {"model": s.model, **check_tensor_model(server.url, s.model, s.artifact, s.manifest)}
            results.append(result)
        for s, result in zip(served, results):
            twin = (
                next((u for u in served if not u.staged and _same_source(s, u)), None) if s.staged else None
            )
            if twin is not None and s.block["mode"] == "llm":
                result["same_as_unsplit"] = check_same_streams(server.url, s.model, twin.model)
            elif twin is not None:
                result["same_as_unsplit"] = check_same_answers(
                    server.url, s.model, twin.model, s.artifact, s.manifest
                )
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
        _log(f"tritonserver stopped (exit {server.proc.returncode})")
    from precast.runtime import load

    for s in served:
        load(s.artifact)  # serving left the artifact exactly as its manifest lists it (no __pycache__)
    return results


def _same_source(a: Served, b: Served) -> bool:
    return (
        a.manifest["source"]["sha256"] == b.manifest["source"]["sha256"]
        and a.block["mode"] == b.block["mode"]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    # `timeout` and CI runners send SIGTERM: unwind through the finally blocks that stop the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="precast-triton-") as tmp:
        results = smoke([a.resolve() for a in args.artifacts], Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    _log("all ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
