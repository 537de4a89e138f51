"""A t5-small-shaped translation model: precast's seq2seq engine vs optimum's ONNX Runtime export
(``ORTModelForSeq2SeqLM.generate``), at 1 and 8 concurrent requests, greedy to a fixed length.

    python benchmarks/bench_seq2seq.py                  # 7 rounds, 64 new tokens
    python benchmarks/bench_seq2seq.py --rounds 3 --new 32

The model: T5Config(d_model 512, d_kv 64, d_ff 2048, 6 + 6 layers, 8 heads, vocab 32128) = t5-small's shape,
random weights N(0, 0.1), built once under --work with tests/seq2seq_models.py. Engines (2 threads each, every one
in its own worker process, loaded once):
  precast     `precast compile FOLDER -o ART` (no --task: text2text-generation), Seq2SeqEngine.generate
  optimum     `optimum-cli export onnx --task text2text-generation-with-past` in --optimum-venv,
              ORTModelForSeq2SeqLM.generate (c8: the 8 sources as one padded batch, its best case)
  precast-AA  a second precast worker: the same engine timed twice (the noise yardstick)
Both generate exactly --new tokens (min_new_tokens = max_new_tokens) from the same 8 sources (lengths 12-60).
A round asks every engine once (order rotated); the table shows median tokens/s over rounds and the ratio to
optimum per round (median and min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import serve_timed  # noqa: E402  (the script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LENGTHS = (12, 60, 25, 40, 18, 52, 33, 47)


def _sources(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(5, vocab - 1, n)] + [1] for n in LENGTHS]


def _worker(kind: str, path: str, threads: int, new: int) -> None:
    if kind == "precast":
        from precast.runtime.seq2seq.engine import Seq2SeqEngine

        eng = Seq2SeqEngine.load(path, threads=threads)
        srcs = _sources(eng.spec.vocab)

        def run(n):
            res = eng.generate(srcs[:n], max_new_tokens=new, min_new_tokens=new, num_beams=1)
            return sum(len(r.tokens) for r in res)
    else:
        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForSeq2SeqLM

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        model = ORTModelForSeq2SeqLM.from_pretrained(path, session_options=so)
        srcs = _sources(model.config.vocab_size)

        def run(n):
            batch = srcs[:n]
            m = max(map(len, batch))
            ids = torch.tensor([s + [0] * (m - len(s)) for s in batch])
            mask = torch.tensor([[1] * len(s) + [0] * (m - len(s)) for s in batch])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                num_beams=1,
                do_sample=False,
            )
            return int((out.shape[1] - 1) * n)

    serve_timed(run, warm_up=1)


def _build(work: Path, venv: Path) -> tuple[Path, Path]:
    folder, art, opt = work / "t5-small", work / "t5-small.precast", work / "t5-small.optimum"
    if not folder.exists():
        sys.path.insert(0, str(REPO))
        from tests.seq2seq_models import make_folder

        make_folder("t5", folder, d_model=512, layers=6, heads=8, d_kv=64)
    if not art.exists():
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from precast.cli.main import main; main()",
                "compile",
                str(folder),
                "-o",
                str(art),
                "--quiet",
            ],
            check=True,
        )
    if not opt.exists():
        subprocess.run(
            [
                str(venv / "bin" / "optimum-cli"),
                "export",
                "onnx",
                "--model",
                str(folder),
                "--task",
                "text2text-generation-with-past",
                str(opt),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return art, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-seq2seq")
    ap.add_argument("--optimum-venv", type=Path, default=REPO / ".cache" / "bench-optimum-venv")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, a.path, a.threads, a.new)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    art, opt = _build(a.work, a.optimum_venv)
    engines = {
        "precast": (sys.executable, art),
        "precast-AA": (sys.executable, art),
        "optimum": (str(a.optimum_venv / "bin" / "python"), opt),
    }
    procs = {}
    for name, (py, path) in engines.items():
        kind = "optimum" if name == "optimum" else "precast"
        procs[name] = subprocess.Popen(
            [
                py,
                __file__,
                "--worker",
                kind,
                "--path",
                str(path),
                "--threads",
                str(a.threads),
                "--new",
                str(a.new),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert procs[name].stdout.readline().strip() == "ready", name
    names = list(engines)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for c in (1, 8):
            order = names[r % 3 :] + names[: r % 3]
            for name in order:
                p = procs[name]
                p.stdin.write(f"{c}\n")
                p.stdin.flush()
                got = json.loads(p.stdout.readline())
                rates.setdefault((name, c), []).append(got["tokens"] / got["s"])
                time.sleep(0.2)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"\nt5-small shape, greedy {a.new} new tokens, {a.threads} threads, {a.rounds} rounds (tokens/s)\n")
    print("| concurrency | precast | optimum (ORT) | precast / optimum | A/A (precast-AA / precast) |")
    print("|---|---|---|---|---|")
    for c in (1, 8):
        mine, theirs, aa = rates[("precast", c)], rates[("optimum", c)], rates[("precast-AA", c)]
        ratio = [m / t for m, t in zip(mine, theirs)]
        aa_r = [x / m for x, m in zip(aa, mine)]
        print(
            f"| {c} | {statistics.median(mine):.0f} | {statistics.median(theirs):.0f} | "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
            f"{statistics.median(aa_r):.2f} ({min(aa_r):.2f}-{max(aa_r):.2f}) |"
        )


if __name__ == "__main__":
    main()
