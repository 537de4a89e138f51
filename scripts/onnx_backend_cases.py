"""Run the ONNX project's own backend test cases through plain ONNX Runtime and through precast.

    python scripts/onnx_backend_cases.py [--kind node,simple,pytorch-converted,pytorch-operator]
                                          [--match REGEX] [--limit N] [--json report.json]

For every case: does plain ONNX Runtime run it right (the case's expected outputs, its tolerances)? If so,
does ``precast compile`` (default ort-cpu pipeline, the case's inputs as sample feeds) compile it, and does
the artifact, loaded through ``precast.runtime``, give the expected outputs too? Prints a summary by outcome
and the first lines of each failure class. Each case runs in a worker process (a native crash loses one case).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator")


def load_cases(kinds, match=None):
    import onnx.backend.test.loader as loader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = []
        if "node" in kinds:
            cases += loader.load_node_model_tests()
        for kind in kinds:
            if kind != "node":
                cases += loader.load_model_tests(kind=kind)
    if match:
        cases = [c for c in cases if re.search(match, c.name)]
    return cases


def _case_io(case):
    """(model proto, [(inputs dict, expected list)]) of a case, read from files when it ships them."""
    import onnx
    from onnx import numpy_helper

    model = case.model if case.model is not None else onnx.load(str(Path(case.model_dir) / "model.onnx"))
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    sets = []
    if case.data_sets is not None:

        def arr(v):  # values numpy cannot hold natively (float8, int4) come as TensorProtos
            return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v

        for inputs, outputs in case.data_sets:
            sets.append((dict(zip(names, map(arr, inputs))), [arr(o) for o in outputs]))
    else:
        for d in sorted(Path(case.model_dir).glob("test_data_set_*")):

            def read(prefix, d=d):
                out = []
                for f in sorted(d.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1])):
                    t = onnx.TensorProto()
                    t.ParseFromString(f.read_bytes())
                    out.append(numpy_helper.to_array(t))
                return out

            sets.append((dict(zip(names, read("input"))), read("output")))
    return model, sets


def _close(expected, actual, rtol, atol) -> bool:
    if isinstance(expected, list) or isinstance(actual, list):  # sequence outputs
        return len(expected) == len(actual) and all(
            _close(e, a, rtol, atol) for e, a in zip(expected, actual)
        )
    e, a = np.asarray(expected), np.asarray(actual)
    if e.shape != a.shape:
        return False
    if e.dtype.kind in "OUS":
        return bool(np.array_equal(e.astype(str), a.astype(str)))
    try:
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
        )
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def run_case(case) -> dict:
    import onnx
    import onnxruntime as ort

    name = case.name
    try:
        model, sets = _case_io(case)
    except Exception as e:  # noqa: BLE001 - a harness: every failure is data
        return {"case": name, "outcome": "unreadable", "why": f"{type(e).__name__}: {e}"[:300]}
    if not sets:
        return {"case": name, "outcome": "no-data"}
    rtol, atol = max(case.rtol, 1e-3), max(case.atol, 1e-6)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ok = all(_close(exp, sess.run(None, feeds), rtol, atol) for feeds, exp in sets)
    except Exception as e:  # noqa: BLE001
        return {"case": name, "outcome": "ort-fails", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    if not ok:
        return {"case": name, "outcome": "ort-wrong"}
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.errors import PrecastError
    from precast.runtime import load

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "model.onnx"
        onnx.save(model, str(src))
        feeds, _ = sets[0]
        try:
            compile_model(
                str(src), Path(tmp) / "art", CompileOptions(sample_inputs=dict(feeds), bisect=False)
            )
        except PrecastError as e:
            return {
                "case": name,
                "outcome": f"refused-{e.exit_code}",
                "why": f"{type(e).__name__}: {e}"[:300],
            }
        except Exception as e:  # noqa: BLE001
            return {"case": name, "outcome": "crash", "why": f"{type(e).__name__}: {e}"[:300]}
        try:
            art = load(Path(tmp) / "art")
            for feeds, exp in sets:
                got = art.run(feeds)
                if not _close(exp, [got[o.name] for o in art.outputs], rtol, atol):
                    return {"case": name, "outcome": "precast-wrong"}
        except PrecastError as e:
            return {
                "case": name,
                "outcome": f"run-refused-{e.exit_code}",
                "why": f"{type(e).__name__}: {e}"[:300],
            }
        except Exception as e:  # noqa: BLE001
            return {"case": name, "outcome": "run-crash", "why": f"{type(e).__name__}: {e}"[:300]}
    return {"case": name, "outcome": "ok"}


def _worker(case):
    import io
    import os

    sys.stdout = io.StringIO()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return run_case(case)
    except BaseException as e:  # noqa: BLE001
        return {"case": case.name, "outcome": "harness-error", "why": repr(e)[:300]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default=",".join(KINDS))
    ap.add_argument("--match", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = load_cases(args.kind.split(","), args.match)[: args.limit]
    results = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, maxtasksperchild=50) as pool:
        it = pool.imap_unordered(_worker, cases)
        while True:
            try:
                results.append(it.next(timeout=300))
            except StopIteration:
                break
            except mp.TimeoutError:
                results.append({"case": "?", "outcome": "timeout"})
                break
    counts = collections.Counter(r["outcome"] for r in results)
    print(f"{len(results)} cases: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    by = collections.defaultdict(list)
    for r in results:
        if r["outcome"] not in ("ok", "ort-fails", "ort-wrong"):
            by[(r["outcome"], re.sub(r"'[^']*'|\d+", "_", r.get("why", ""))[:90])].append(r["case"])
    for (outcome, why), names in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(names):4d} {outcome}: {why}  e.g. {', '.join(sorted(names)[:4])}")
    if args.json:
        Path(args.json).write_text(json.dumps(sorted(results, key=lambda r: r["case"]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
