"""Image and audio classifiers: precast's artifacts vs ONNX Runtime and OpenVINO on optimum's export.

    python benchmarks/bench_tasks.py                              # all models, 15 rounds
    python benchmarks/bench_tasks.py --models vit-b16 --batches 1 --rounds 30
    python benchmarks/bench_tasks.py --quick                      # 3 rounds, batch 1: does everything run?

Models (random weights, seeded, built once from transformers configs into HF folders under --work: config.json,
model.safetensors, preprocessor_config.json; no hub): resnet50 (ResNetForImageClassification, ResNetConfig's
defaults = ResNet-50, 1000 labels), vit-b16 (ViTForImageClassification, ViT-B/16 at 224, 1000 labels),
wav2vec2-base (Wav2Vec2ForCTC, Wav2Vec2Config's defaults = base, vocab 32) on 10 s of 16 kHz audio.
Engines, every one with 2 threads (--threads), each in its own worker process, loaded once:
  precast-ort   `precast compile FOLDER -o ART --target ort-cpu`, run by precast.runtime.load(ART, threads)
  precast-ov    the same with --target openvino
  ort           ONNX Runtime (ORT_ENABLE_ALL) on optimum's export (`optimum-cli export onnx`, in --optimum-venv)
  ort-opt       ONNX Runtime on that export after onnxruntime.transformers' optimizer (vit: model_type vit, as
                optimum's ORTOptimizer does; wav2vec2: model_type bert; resnet has no such pass: not run)
  ov            OpenVINO's CPU plugin compiling optimum's export, its shapes made static per batch
                (PERFORMANCE_HINT LATENCY, INFERENCE_NUM_THREADS, INFERENCE_PRECISION_HINT f32: on a CPU with
                bf16, OpenVINO would otherwise compute in bf16 and compare bf16 against fp32)
  A/A           a second worker of --aa (default ort): the same engine timed twice, the noise yardstick
Every engine gets the same inputs (seeded images / waveforms through the folder's own preprocessor); each
engine's logits are checked against torch eager's (max abs diff, cosine) before timing. A round asks every
engine once, in an order rotated every round, with --gap seconds of quiet between engines (ONNX Runtime's
threads spin for a while after a run); one ask runs the model --reps times back to back (auto: enough for
~0.3 s) and reports their median. Ratios are taken within a round against the best anchor (the anchor with
the lowest median of ort, ort-opt, ov), then the median and p10-p90 over rounds are shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _common import JsonWorker  # (benchmarks/: this script's folder, first on sys.path)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ANCHORS = ("ort", "ort-opt", "ov")
PRECAST = ("precast-ort", "precast-ov")
AUDIO_SECONDS, RATE = 10.0, 16000


@dataclass(frozen=True)
class TaskModel:
    name: str
    task: str  # precast's and optimum's task name
    audio: bool
    ort_opt: str | None  # onnxruntime.transformers model_type, None: no fusion pass applies


MODELS = {
    m.name: m
    for m in (
        TaskModel("resnet50", "image-classification", False, None),
        TaskModel("vit-b16", "image-classification", False, "vit"),
        TaskModel("wav2vec2-base", "automatic-speech-recognition", True, "bert"),
    )
}


# ---------------------------------------------------------------- build (a child process: torch stays out of the driver)


def build_folder(name: str, folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "resnet50":
        model = transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=1000))
        proc = transformers.ConvNextImageProcessor(  # microsoft/resnet-50's preprocessing
            size={"shortest_edge": 224}, crop_pct=0.875, resample=3,
            image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
        )  # fmt: skip
    elif name == "vit-b16":
        cfg = transformers.ViTConfig(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            patch_size=16, image_size=224, num_labels=1000,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(cfg)
        proc = transformers.ViTImageProcessor(size={"height": 224, "width": 224})
    else:
        model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(vocab_size=32))
        proc = transformers.Wav2Vec2FeatureExtractor(
            feature_size=1,
            sampling_rate=RATE,
            padding_value=0.0,
            do_normalize=True,
            return_attention_mask=False,
        )
    model.eval().save_pretrained(folder)
    proc.save_pretrained(folder)


def sample_inputs(audio: bool, batch: int) -> list[np.ndarray]:
    """Deterministic raw inputs: uint8 images of odd sizes (gradients, a disc, stripes, noise), or 10 s
    speech-like waveforms (a gliding harmonic tone, syllable-rate envelope, noise)."""
    rng = np.random.default_rng(1234 + batch)
    out = []
    for i in range(batch):
        if audio:
            t = np.arange(int(AUDIO_SECONDS * RATE)) / RATE
            f0 = 110 + 40 * i + 30 * np.sin(2 * np.pi * 0.3 * t)
            phase = 2 * np.pi * np.cumsum(f0) / RATE
            tone = sum(np.sin(k * phase) / k for k in range(1, 6))
            env = 0.5 + 0.5 * np.sin(2 * np.pi * (3 + 0.2 * i) * t) ** 2
            out.append((0.3 * tone * env + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
        else:
            h, w = 300 + 17 * i, 400 - 11 * i
            yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
            r = 127 + 120 * np.sin(xx / w * np.pi * (i + 2))
            g = 255 * yy / h
            disc = (yy - h * 0.4) ** 2 + (xx - w * 0.6) ** 2 < (min(h, w) * 0.25) ** 2
            b = np.where(disc, 230.0, 30.0) + 40 * ((xx // 16 + yy // 16) % 2)
            img = np.stack([r, g, b], -1) + rng.normal(0, 6, (h, w, 3))
            out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def build(name: str, folder: Path, inputs: Path, batches: list[int], threads: int) -> None:
    """The HF folder (once), then per batch: the preprocessed feeds and torch eager's logits."""
    import torch
    import transformers

    if not (folder / "model.safetensors").is_file():
        build_folder(name, folder)
    torch.set_num_threads(threads)
    spec = MODELS[name]
    auto = transformers.AutoModelForCTC if spec.audio else transformers.AutoModelForImageClassification
    model = auto.from_pretrained(str(folder), local_files_only=True).eval()
    if spec.audio:
        proc = transformers.AutoFeatureExtractor.from_pretrained(str(folder), local_files_only=True)
    else:
        proc = transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    inputs.mkdir(parents=True, exist_ok=True)
    for b in batches:
        if (inputs / f"ref-b{b}.npy").is_file():
            continue
        raw = sample_inputs(spec.audio, b)
        kw = {"sampling_rate": RATE} if spec.audio else {}
        feeds = {
            k: np.ascontiguousarray(v, np.float32) for k, v in proc(raw, return_tensors="np", **kw).items()
        }
        feeds = {k: v for k, v in feeds.items() if k in ("pixel_values", "input_values")}
        with torch.inference_mode():
            ref = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
        np.savez(inputs / f"feeds-b{b}.npz", **feeds)
        np.save(inputs / f"ref-b{b}.npy", ref)


def ort_optimize(src: Path, dst: Path, model_type: str) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(src), model_type=model_type, num_heads=12, hidden_size=768)
    opt.save_model_to_file(str(dst))
    fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    print(f"{dst.name}: {len(opt.model.graph.node)} nodes, fused {fused}", file=sys.stderr)


# ---------------------------------------------------------------- worker (one engine, JSON lines on stdin/stdout)


def open_engine(kind: str, path: Path, threads: int, batches: dict[int, dict[str, np.ndarray]]):
    """run(batch) -> logits, and a label. OpenVINO's anchor compiles one static-shape model per batch."""
    if kind.startswith("precast"):
        from precast.runtime import load

        model = load(path, threads=threads)
        names, out = [s.name for s in model.inputs], model.outputs[0].name
        missing = [n for n in names if n not in next(iter(batches.values()))]
        if missing:  # the folders' processors give pixel_values / input_values and nothing else
            raise ValueError(f"artifact inputs {missing} are not in the feeds")

        def run(b):
            return model.run({n: batches[b][n] for n in names}, [out])[out]

        return run, f"precast {model.target} ({model.manifest.target.precision or '?'})"
    if kind in ("ort", "ort-opt"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return (
            lambda b: sess.run(None, {name: next(iter(batches[b].values()))})[0]
        ), f"onnxruntime {ort.__version__}"
    if kind == "ov":
        import openvino as ov

        core = ov.Core()
        config = {
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": str(threads),
            "INFERENCE_PRECISION_HINT": "f32",
        }
        compiled = {}
        for b, f in batches.items():
            m = core.read_model(str(path))
            m.reshape({m.inputs[0].get_any_name(): list(next(iter(f.values())).shape)})
            compiled[b] = core.compile_model(m, "CPU", config).create_infer_request()
        prec = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
        return (
            lambda b: next(iter(compiled[b].infer([next(iter(batches[b].values()))]).values())).copy(),
            f"openvino {ov.__version__} (CPU default precision {prec}, forced f32)",
        )
    raise ValueError(f"unknown engine kind {kind!r}")


def worker(
    kind: str, path: Path, inputs: Path, outdir: Path, batch_list: list[int], threads: int, warmup: int
) -> None:
    proto, sys.stdout = sys.stdout, sys.stderr  # libraries' prints go to the log, never into the protocol
    try:
        batches = {b: dict(np.load(inputs / f"feeds-b{b}.npz", allow_pickle=False)) for b in batch_list}
        t0 = time.perf_counter()
        run, label = open_engine(kind, path, threads, batches)
        for b in batch_list:
            np.save(outdir / f"b{b}.npy", run(b))
            for _ in range(warmup):
                run(b)
        ready = {"ready": label, "load_s": time.perf_counter() - t0}
    except Exception as e:  # the driver prints it as this engine's note and goes on without it
        ready = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    print(json.dumps(ready), file=proto, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        times = []
        for _ in range(req["reps"]):
            t0 = time.perf_counter()
            run(req["batch"])
            times.append(time.perf_counter() - t0)
        print(json.dumps({"s": statistics.median(times)}), file=proto, flush=True)


class Worker(JsonWorker):
    def __init__(self, name: str, kind: str, path: Path, inputs: Path, work: Path, a: argparse.Namespace):
        self.name, self.out = name, work / "outputs" / name
        self.out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "_worker", kind, str(path), str(inputs), str(self.out),
               ",".join(map(str, a.batches_now)), str(a.threads), str(a.warmup)]  # fmt: skip
        super().__init__(cmd, work / "logs" / f"{name}.log")
        self.label, self.load_s = self.first.get("ready"), self.first.get("load_s")

    def time(self, batch: int, reps: int) -> float:
        r = self.ask(op="time", batch=batch, reps=reps)
        if "error" in r:
            raise RuntimeError(f"{self.name}: {r['error']}")
        return r["s"]


# ---------------------------------------------------------------- driver


def step(what: str, cmd: list[str], log: Path) -> str | None:
    """Run one preparation step (a child process); None on success, else its last line of output."""
    print(f"  {what} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    print(f"  {what}: {'ok' if rc == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return None if rc == 0 else f"{what} failed (rc {rc}): {lines[-1] if lines else '?'} (log {log})"


def prepare(
    spec: TaskModel, a: argparse.Namespace
) -> tuple[dict[str, tuple[str, Path]], dict[str, str], Path]:
    """Folder, feeds, references, exports and artifacts of one model -> {engine: (kind, path)}, notes, inputs."""
    root = a.work / spec.name
    folder, inputs, logs = root / "hf", root / "inputs", root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    notes: dict[str, str] = {}
    me = [sys.executable, __file__]
    batches = ",".join(map(str, a.batches_now))
    build = [*me, "_build", spec.name, str(folder), str(inputs), batches, str(a.threads)]
    err = step("build folder, feeds, torch logits", build, logs / "build.log")
    if err:
        raise SystemExit(f"{spec.name}: {err}")
    engines: dict[str, tuple[str, Path]] = {}
    export = root / "optimum" / "model.onnx"
    if not export.is_file():
        cli = a.optimum_venv / "bin" / "optimum-cli"
        cmd = [str(cli), "export", "onnx", "--model", str(folder), "--task", spec.task, str(export.parent)]
        why = step("optimum export", cmd, logs / "optimum.log") if cli.is_file() else f"no {cli} (README)"
    if not export.is_file():
        notes["ort"] = notes["ov"] = notes["ort-opt"] = why or "no model.onnx"
    else:
        engines["ort"], engines["ov"] = ("ort", export), ("ov", export)
    fused = export.with_name(f"model_{spec.ort_opt}_opt.onnx")
    if export.is_file() and spec.ort_opt:
        optimize = [*me, "_ortopt", str(export), str(fused), spec.ort_opt]
        err = None if fused.is_file() else step("ORT transformers optimizer", optimize, logs / "ortopt.log")
        if err:
            notes["ort-opt"] = err
        else:
            engines["ort-opt"] = ("ort-opt", fused)
    for key, target in (("precast-ort", "ort-cpu"), ("precast-ov", "openvino")):
        if key not in a.engines and key != a.aa:
            continue
        art = root / f"precast-{target}"
        if not (art / "manifest.json").is_file() or not a.keep_artifacts:
            shutil.rmtree(art, ignore_errors=True)
            cmd = ["precast", "compile", str(folder), "-o", str(art), "--target", target]
            err = step(f"precast compile --target {target}", cmd, logs / f"compile-{target}.log")
            if err:
                notes[key] = err
                continue
        engines[key] = (key, art)
    return {k: v for k, v in engines.items() if k in a.engines or k == a.aa}, notes, inputs


def pctl(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def cosine(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def bench_model(spec: TaskModel, a: argparse.Namespace) -> dict:
    a.batches_now = a.audio_batches if spec.audio else a.batches
    print(f"{spec.name}: preparing", file=sys.stderr, flush=True)
    engines, notes, inputs = prepare(spec, a)
    run = [e for e in a.engines if e in engines]
    if a.aa in engines:
        run.append("A/A")
    (a.work / spec.name / "logs").mkdir(exist_ok=True)
    workers: dict[str, Worker] = {}
    try:
        for name in run:
            kind, path = engines[a.aa if name == "A/A" else name]
            print(f"  starting {name}", file=sys.stderr, flush=True)
            w = Worker(name.replace("/", ""), kind, path, inputs, a.work / spec.name, a)
            if w.error:
                notes[name] = w.error
                w.close()
            else:
                workers[name] = w
        result = {"notes": notes, "labels": {n: w.label for n, w in workers.items()}, "batches": {}}
        for b in a.batches_now:
            ref = np.load(inputs / f"ref-b{b}.npy", allow_pickle=False)
            check = {}
            for n, w in workers.items():
                got = np.load(w.out / f"b{b}.npy", allow_pickle=False)
                check[n] = (
                    (float(np.abs(got - ref).max()), cosine(got, ref))
                    if got.shape == ref.shape
                    else (math.inf, 0.0)
                )
            load0 = os.getloadavg()[0]
            rounds = measure(workers, b, a)
            result["batches"][b] = {
                "check": check,
                "rounds": rounds,
                "ref_absmax": float(np.abs(ref).max()),
                "load": (load0, os.getloadavg()[0]),
            }
        return result
    finally:
        for w in workers.values():
            w.close()


def measure(workers: dict[str, Worker], batch: int, a: argparse.Namespace) -> dict[str, list[float]]:
    names = list(workers)
    one = min(workers[n].time(batch, 1) for n in names)  # the fastest engine's ask lasts >= ~0.3 s
    reps = a.reps or max(1, min(10, math.ceil(0.3 / one)))
    what = f"{a.rounds} rounds x {len(names)} engines, {reps} reps per ask (~{one:.2f}s a run)"
    print(f"  batch {batch}: {what}", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(workers[n].time(batch, reps))
            time.sleep(a.gap)
    return times


def spread(rat: list[float]) -> str:
    return f"{statistics.median(rat):.3f} ({pctl(rat, 10):.3f}-{pctl(rat, 90):.3f})"


def fastest(names: list[str], t: dict[str, list[float]]) -> str | None:
    """The engine with the lowest median per-round time relative to the first one: when other work comes and
    goes the times are bimodal, and a plain median can pick the engine that the round-by-round ratio says is
    slower."""
    if not names:
        return None
    return min(names, key=lambda n: statistics.median(x / y for x, y in zip(t[n], t[names[0]])))


def report(spec: TaskModel, res: dict, aa: str) -> list[str]:
    """Markdown: one table per batch, then precast's best target against the best anchor."""
    lines = [f"- {spec.name}: {n} not run: {why}" for n, why in res["notes"].items() if why]
    for b, r in res["batches"].items():
        t = r["rounds"]
        med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
        anchors = [n for n in ANCHORS if n in t]
        best = fastest(anchors, t)
        what = f" ({AUDIO_SECONDS:.0f} s of audio a row)" if spec.audio else ""
        load = "1-min load {:.1f} -> {:.1f}".format(*r["load"])
        lines += [
            "",
            f"### {spec.name}, batch {b}{what}; {len(next(iter(t.values())))} rounds, {load}",
            "",
            "| engine | median ms | min ms | p10-p90 ms | / best anchor (p10-p90) | max abs diff | cosine vs torch |",
            "|---|---|---|---|---|---|---|",
        ]
        for n in t:
            base = aa if n == "A/A" else best
            ratio = spread([x / y for x, y in zip(t[n], t[base])]) if base else "-"
            d, c = r["check"][n]
            flag = "" if c > 0.9999 else " **WRONG?**"
            name = f"{aa} again (A/A)" if n == "A/A" else f"{n}{' (best anchor)' if n == best else ''}"
            ms = [x * 1e3 for x in t[n]]
            lines.append(
                f"| {name} | {med[n]:.1f} | {min(ms):.1f} | {pctl(ms, 10):.1f}-{pctl(ms, 90):.1f} | "
                f"{'A/A ' if n == 'A/A' else ''}{ratio} | {d:.2e} | {c:.7f}{flag} |"
            )
        ours = [n for n in PRECAST if n in t]
        if best and ours:
            top = fastest(ours, t)
            rat = spread([x / y for x, y in zip(t[top], t[best])])
            lines.append(
                f"\nprecast's best target: {top}, {rat} x the time of {best} (median, p10-p90 over rounds; "
                f"|logits| max {r['ref_absmax']:.3g})"
            )
    return lines


def host_line() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    flags = set(
        next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
        ).split()
    )
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return f"{cpu}, {os.cpu_count()} CPUs, {' '.join(isa)}"


def versions() -> str:
    import onnxruntime
    import openvino

    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "-uno"], cwd=REPO, capture_output=True, text=True
    ).stdout
    return f"precast {rev}{'+dirty' if dirty.strip() else ''}, onnxruntime {onnxruntime.__version__}, openvino {openvino.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="image batch sizes (default 1 8)")
    ap.add_argument(
        "--audio-batches", type=int, nargs="+", default=[1, 4], help="wav2vec2 batch sizes (default 1 4)"
    )
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per model and batch (default 15)")
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed runs per engine and batch at load (default 3)"
    )
    ap.add_argument(
        "--reps", type=int, default=0, help="runs per ask, median taken (default 0: auto, ~0.3 s)"
    )
    ap.add_argument("--gap", type=float, default=0.2, help="seconds of quiet between two engines' asks")
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    ap.add_argument(
        "--engines", default=",".join((*PRECAST, *ANCHORS)), help="comma-separated engines to run"
    )
    ap.add_argument("--aa", default="ort", choices=(*PRECAST, *ANCHORS), help="engine timed twice (A/A row)")
    ap.add_argument(
        "--work", type=Path, default=REPO / ".cache" / "bench-tasks", help="folders, exports, artifacts"
    )
    ap.add_argument("--optimum-venv", type=Path, default=REPO / ".cache" / "bench-optimum-venv")
    ap.add_argument("--keep-artifacts", action="store_true", help="reuse precast artifacts already in --work")
    ap.add_argument("--quick", action="store_true", help="3 rounds, batch 1 only, 1 warm-up run")
    ap.add_argument("--json", type=Path, default=None, help="also write every round's times here")
    ap.add_argument(
        "--tables-from", type=Path, default=None, help="print the tables of a --json file; no run"
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.warmup, a.batches, a.audio_batches = 3, 1, [1], [1]
    a.models, a.engines = a.models.split(","), a.engines.split(",")
    for m in a.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    a.work = a.work.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_build"]:
        name, folder, inputs, batches, threads = argv[1:]
        build(name, Path(folder), Path(inputs), [int(b) for b in batches.split(",")], int(threads))
        return 0
    if argv[:1] == ["_ortopt"]:
        ort_optimize(Path(argv[1]), Path(argv[2]), argv[3])
        return 0
    if argv[:1] == ["_worker"]:
        kind, path, inputs, out, batches, threads, warmup = argv[1:]
        worker(
            kind,
            Path(path),
            Path(inputs),
            Path(out),
            [int(b) for b in batches.split(",")],
            int(threads),
            int(warmup),
        )
        return 0
    a = parse_args(argv)
    if a.tables_from:  # re-render a --json dump
        dump = json.loads(a.tables_from.read_text())
        out = list(dump.pop("header", []))
        for name, res in dump.items():
            res["batches"] = {int(b): r for b, r in res["batches"].items()}
            out += report(MODELS[name], res, res.get("aa", "ort"))
        print("\n".join(out))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still ends its workers (finally)
    load0, t0 = os.getloadavg(), time.time()
    header = [
        f"# bench_tasks: {host_line()}",
        f"{versions()}; {a.threads} threads; {a.rounds} rounds; 1-min load at start {load0[0]:.2f}",
    ]
    out, dump = [*header, ""], {}
    for name in a.models:
        res = bench_model(MODELS[name], a)
        dump[name] = {**res, "aa": a.aa}
        lines = report(MODELS[name], res, a.aa)
        out += lines
        print("\n".join(lines), file=sys.stderr)
    load1 = os.getloadavg()
    out += [
        "",
        f"1-min load average {load0[0]:.2f} at start, {load1[0]:.2f} at end, {os.cpu_count()} CPUs; "
        f"{(time.time() - t0) / 60:.1f} min. Ratios: engine time / best anchor time in the same round "
        "(<1: faster than the best anchor); A/A: the same engine's second worker / its first.",
    ]
    print("\n".join(out))
    if a.json:
        for res in dump.values():
            res["batches"] = {str(b): r for b, r in res["batches"].items()}
        a.json.write_text(json.dumps({"header": header, **dump}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
