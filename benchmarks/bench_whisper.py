"""Whisper on 30 s of audio, greedy to 64 tokens: precast vs OpenVINO GenAI's WhisperPipeline and
onnxruntime-genai's Whisper, side by side (real-time factor and first-token latency).

    python benchmarks/bench_whisper.py                        # whisper-tiny and -base shapes, 7 rounds
    python benchmarks/bench_whisper.py --models tiny --rounds 3
    python benchmarks/bench_whisper.py --precision int4        # INT4 weights: each engine's own INT4 recipe

Models: WhisperConfig with whisper-tiny's shape (d_model 384, 4 + 4 layers, 6 heads) and whisper-base's (512, 6 + 6,
8 heads), vocab 51865, random weights N(0, 0.1), built once under --work (tests/seq2seq_models.py). Engines, 2 threads
each, every one in its own worker process, loaded once:
  precast      `precast compile FOLDER -o ART` (task inferred), Seq2SeqEngine.transcribe on the WAV's bytes
  precast-AA   a second precast worker (the same engine timed twice: the noise yardstick)
  ov-genai     `optimum-cli export openvino --task automatic-speech-recognition-with-past --weight-format fp32`,
               openvino_genai.WhisperPipeline (INFERENCE_PRECISION_HINT f32: this CPU would otherwise use bf16)
  ort-genai    `python -m onnxruntime_genai.models.builder -p fp32 -e cpu`, og.Generator over og.Audios.open(WAV)
--precision int4: precast `--passes 'default,quantize-int4{accuracy_level=4}'` (MatMulNBits, block 32, the lm head
and the embedding tables too), OpenVINO `--weight-format int4`, onnxruntime-genai `-p int4`; int8: precast
`quantize-int4{bits=8}` is not there, so `quantize-int8` (dynamic), OpenVINO `--weight-format int8`, genai `-p int8`.
Every engine reads the same 30 s WAV (a chirp + noise), decodes with language en, task transcribe, no timestamps,
exactly 64 new tokens (min = max). "first token": the same call with 1 new token (audio read, features, encoder,
one decoder step). RTF = seconds / 30. A round asks every engine once (order rotated); medians over rounds, and the
ratio anchor / precast per round (> 1: precast faster) with its min-max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
from _common import serve_timed  # noqa: E402  (the script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHAPES = {"tiny": dict(d_model=384, layers=4, heads=6), "base": dict(d_model=512, layers=6, heads=8)}
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def _worker(kind: str, path: str, wav: str, threads: int) -> None:
    if kind == "precast":
        from precast.runtime.processing.whisper import read_audio
        from precast.runtime.seq2seq.engine import Seq2SeqEngine

        eng = Seq2SeqEngine.load(path, threads=threads)

        def run(n):
            samples = read_audio(Path(wav).read_bytes(), wav, 16000)
            return len(eng.transcribe(samples, max_new_tokens=n, min_new_tokens=n, language="en").tokens)
    elif kind == "ov-genai":
        import openvino_genai as ov

        pipe = ov.WhisperPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads, INFERENCE_PRECISION_HINT="f32")

        def run(n):
            with wave.open(wav) as w:
                x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
            cfg = pipe.get_generation_config()
            cfg.max_new_tokens, cfg.min_new_tokens = n, n
            cfg.language, cfg.task, cfg.return_timestamps = "<|en|>", "transcribe", False
            r = pipe.generate(x.tolist(), cfg)
            return int(r.perf_metrics.get_num_generated_tokens())
    else:
        import onnxruntime_genai as og

        cfg = og.Config(path)
        cfg.clear_providers()
        model = og.Model(cfg)
        proc = model.create_multimodal_processor()

        def run(n):
            inputs = proc(PROMPT, audios=og.Audios.open(wav))
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=4 + n, min_length=4 + n, do_sample=False, batch_size=1)
            gen = og.Generator(model, params)
            gen.set_inputs(inputs)
            k = 0
            while not gen.is_done():
                gen.generate_next_token()
                k += 1
            return k

    serve_timed(run, warm_up=4)


def _wav(path: Path) -> None:
    rng = np.random.default_rng(0)
    t = np.arange(30 * 16000) / 16000
    x = 0.2 * np.sin(2 * np.pi * (200 + 300 * t / 30) * t) + 0.03 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((x * 32767).astype("<i2").tobytes())


PASSES = {"fp32": None, "int4": "default,quantize-int4{accuracy_level=4}", "int8": "default,quantize-int8"}


def _build(work: Path, name: str, ov_venv: Path, genai_venv: Path, precision: str) -> dict[str, Path]:
    folder = work / f"whisper-{name}"
    tag = "" if precision == "fp32" else f"-{precision}"
    out = {
        "precast": work / f"whisper-{name}.precast{tag}",
        "ov-genai": work / f"whisper-{name}.ov{tag}",
        "ort-genai": work / f"whisper-{name}.genai{tag}",
    }
    quiet = dict(check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not folder.exists():
        sys.path.insert(0, str(REPO))
        from tests.seq2seq_models import make_folder

        make_folder("whisper", folder, **SHAPES[name])
    cli = [sys.executable, "-c", "from precast.cli.main import main; main()"]
    passes = ["--passes", PASSES[precision]] if PASSES[precision] else []
    if not out["precast"].exists():
        subprocess.run([*cli, "compile", str(folder), "-o", str(out["precast"]), "--quiet", *passes], **quiet)
    if not out["ov-genai"].exists():
        task = "automatic-speech-recognition-with-past"
        optimum = str(ov_venv / "bin" / "optimum-cli")
        cmd = [optimum, "export", "openvino", "--model", str(folder), "--task", task]
        subprocess.run([*cmd, "--weight-format", precision, str(out["ov-genai"])], **quiet)
    if not out["ort-genai"].exists():
        builder = [str(genai_venv / "bin" / "python"), "-m", "onnxruntime_genai.models.builder"]
        cmd = [*builder, "-i", str(folder), "-o", str(out["ort-genai"]), "-p", precision, "-e", "cpu"]
        subprocess.run(cmd, cwd="/tmp", **quiet)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,base")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=sorted(PASSES), default="fp32")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-whisper")
    ap.add_argument("--ov-venv", type=Path, default=Path("/work/venvs/ovgenai"))
    ap.add_argument("--genai-venv", type=Path, default=Path("/work/venvs/genai"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--wav", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, a.path, a.wav, a.threads)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    wav = a.work / "chirp30.wav"
    if not wav.exists():
        _wav(wav)
    pythons = {
        "precast": sys.executable,
        "precast-AA": sys.executable,
        "ov-genai": str(a.ov_venv / "bin" / "python"),
        "ort-genai": str(a.genai_venv / "bin" / "python"),
    }
    for name in a.models.split(","):
        paths = _build(a.work, name, a.ov_venv, a.genai_venv, a.precision)
        procs = {}
        for eng, py in pythons.items():
            kind = "precast" if eng.startswith("precast") else eng
            procs[eng] = subprocess.Popen(
                [
                    py,
                    __file__,
                    "--worker",
                    kind,
                    "--path",
                    str(paths[kind]),
                    "--wav",
                    str(wav),
                    "--threads",
                    str(a.threads),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd="/tmp",
            )
            line = procs[eng].stdout.readline().strip()
            assert line == "ready", f"{eng}: {line!r}"
        times: dict[tuple[str, int], list[float]] = {}
        tokens: dict[str, int] = {}
        engines = list(pythons)
        for r in range(a.rounds):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for n in (1, 64):
                for eng in order:
                    p = procs[eng]
                    p.stdin.write(f"{n}\n")
                    p.stdin.flush()
                    got = json.loads(p.stdout.readline())
                    times.setdefault((eng, n), []).append(got["s"])
                    if n == 64:
                        tokens[eng] = got["tokens"]
                    time.sleep(0.2)
        for p in procs.values():
            p.stdin.close()
            p.wait()
        print(
            f"\nwhisper-{name} shape, 30 s of audio, greedy 64 tokens, {a.threads} threads, {a.rounds} rounds "
            f"(tokens: {tokens})\n"
        )
        print("| engine | RTF (64 tokens) | first token (s) | anchor / precast, 64 tokens | first token |")
        print("|---|---|---|---|---|")
        for eng in engines:
            full, first = times[(eng, 64)], times[(eng, 1)]
            r_full = [x / m for x, m in zip(full, times[("precast", 64)])]
            r_first = [x / m for x, m in zip(first, times[("precast", 1)])]
            print(
                f"| {eng} | {statistics.median(full) / 30:.4f} | {statistics.median(first):.3f} | "
                f"{statistics.median(r_full):.2f} ({min(r_full):.2f}-{max(r_full):.2f}) | "
                f"{statistics.median(r_first):.2f} ({min(r_first):.2f}-{max(r_first):.2f}) |"
            )


if __name__ == "__main__":
    main()
