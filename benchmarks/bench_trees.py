"""The same work under two source trees, interleaved: compile time and LLM decode speed (a refactor's check).

    python benchmarks/bench_trees.py --base REV [--head REV] [--rounds 5]

REV is a git revision of this repository (--head defaults to the working tree). Each tree is exported
with `git archive` (the working tree: its files as they are), and its package folders are put on the path
as `precast` through a folder of symlinks (the folders are the packages, shared/design.md "Layout"). Every
measurement runs in a fresh process of one tree. A round runs base, head and base again, each taking each
slot of a round in turn, so drift on the shared cores and the order hit all three alike; "base again"
against "base" is the A/A spread. The decode artifact is compiled once, by the base tree: the head tree
loading it and giving the same tokens is checked too.

Rows (medians over rounds; head/base, and A/A = base again / base):
  compile          s, the tests' MLP (hidden 256) ONNX file -> ort-cpu, default pipeline, verified, no cache
  decode b1        ms per token, one request, 64 new tokens, greedy
  decode b4        ms per step, four requests together, 64 new tokens each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm_engine import SMALL  # noqa: E402  (the same small Llama as the engine benchmark)

FOLDERS = ("compiler", "passes", "targets", "runtime", "cli", "artifact", "ir")

COMPILE = """
import json, sys, time
from precast.compiler.driver import compile_model
from precast.compiler.plan import CompileOptions
t = time.perf_counter()
compile_model(sys.argv[1], sys.argv[2], CompileOptions(targets=("ort-cpu",)))
print(json.dumps({"s": time.perf_counter() - t}))
"""

DECODE = """
import json, sys, time
from precast.runtime.llm import Engine, SamplingParams
engine = Engine.load(sys.argv[1])
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(24 + 8 * i)] for i in range(4)]
engine.generate(prompts[0], params)  # warm-up
def run(ps):
    handles = [engine.submit(p, params) for p in ps]
    t = time.perf_counter()
    engine.run_until_done()
    wall = time.perf_counter() - t
    done = [h.result() for h in handles]
    decode = wall - max(c.ttft_s for c in done)
    return decode * 1000 / 63, [c.token_ids for c in done]
b1, tokens = run(prompts[:1])
b4, tokens4 = run(prompts)
print(json.dumps({"b1": b1, "b4": b4, "tokens": tokens + tokens4}))
"""


def farm(tree: Path, out: Path) -> Path:
    """``out``/precast: the tree's precast/ files plus its package folders, so PYTHONPATH=out imports it."""
    pkg = out / "precast"
    pkg.mkdir(parents=True)
    for f in (tree / "precast").iterdir():
        (pkg / f.name).symlink_to(f)
    for name in FOLDERS:
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree / name)
    return out


def export(rev: str | None, dest: Path) -> Path:
    dest.mkdir(parents=True)
    if rev is None:
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
        for f in files:
            if (REPO / f).is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                (dest / f).write_bytes((REPO / f).read_bytes())
    else:
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_in(path: Path, code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=path)
    if r.returncode:
        raise SystemExit(f"error: a run failed under {path}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.3f}"


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default=None, help="a revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="precast-trees-"))
    trees = {"base": farm(export(args.base, work / "src-base"), work / "base"),
             "head": farm(export(args.head, work / "src-head"), work / "head")}
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = str(trees["base"])
    from tests.helpers import save, tiny_mlp  # noqa: E402  (the test models: numpy + onnx only)
    from tests.llm.fixtures import build_llama  # noqa: E402

    mlp = work / "mlp.onnx"
    save(tiny_mlp(hidden=256), mlp)
    llama = build_llama(work / "hf", **SMALL)
    art = work / "llm"
    run_in(trees["base"], COMPILE.replace("CompileOptions(targets=(\"ort-cpu\",))",
                                          "CompileOptions(targets=(\"ort-cpu\",), task=\"causal-lm\")"),
           str(llama), str(art))
    rows: dict[str, dict[str, list[float]]] = {k: {"compile": [], "b1": [], "b4": []} for k in ("base", "base2", "head")}
    tokens = {}
    order = ["base", "head", "base2"]
    for i in range(args.rounds):
        for name in order[i % 3 :] + order[: i % 3]:  # each tree takes each slot of a round in turn
            tree = trees["base" if name == "base2" else name]
            rows[name]["compile"].append(run_in(tree, COMPILE, str(mlp), str(work / f"c-{name}-{i}"))["s"])
            d = run_in(tree, DECODE, str(art))
            rows[name]["b1"].append(d["b1"])
            rows[name]["b4"].append(d["b4"])
            tokens[name] = d["tokens"]
    same = tokens["head"] == tokens["base"] == tokens["base2"]
    print(f"{'row':<12}{'base':>9}{'head':>9}{'head/base':>11}{'A/A':>8}   spread base | head")
    for key, label in (("compile", "compile s"), ("b1", "decode b1"), ("b4", "decode b4")):
        b, h, a = rows["base"][key], rows["head"][key], rows["base2"][key]
        ratio = statistics.median(h) / statistics.median(b)
        aa = statistics.median(a) / statistics.median(b)
        print(f"{label:<12}{med(b)}{med(h)}{ratio:>11.3f}{aa:>8.3f}   {spread(b)} | {spread(h)}")
    print(f"tokens: head {'==' if same else '!='} base on the artifact the base tree compiled")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
