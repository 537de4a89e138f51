"""MatMul -> LayerNorm -> GeLU chain: what `fuse-matmul-layernorm-gelu` buys on ONNX Runtime CPU.

    python benchmarks/bench_chain.py [--rounds 200] [--threads 2] [--hidden 384] [--inner 1536]

A synthetic graph x[B,128,hidden] -> MatMul(hidden x inner) -> Add(bias) -> LayerNormalization -> Gelu,
stacked `--layers` times (inner -> hidden projection between chains, as in an MLP tower). Variants, all
ORT CPU sessions at ORT_ENABLE_ALL with the same thread count:
  plain          the graph as exported (ONNX LayerNormalization + opset-20 Gelu)
  precast-before precast's ort-cpu default pipeline (LN + com.microsoft Gelu)
  precast        the default pipeline plus fuse-matmul-layernorm-gelu after fuse-gelu
                 (centred MatMul + Add + SimplifiedLayerNormalization + BiasGelu)
  +gemm2d        precast's output with each 3-D MatMul+Add flattened to a 2-D Gemm by hand (not a pass:
                 measured here to decide whether it is worth one)
Timing for a loaded machine: every round runs every variant once in a rotating order; the table gives
the median ms and the median of the per-round ratios to `precast-before` (ratios cancel the load that
a round sees). The load average is printed before and after.

Measured (2 shared cores, load average 4.5-4.7, 4 stacked chains, 120 rounds): precast 1.046 at batch 1 and
1.134 at batch 8 of precast-before; +gemm2d 1.080 / 1.152. The rewrite is exact but slower on ORT CPU,
so the ort-cpu default pipeline does not run it. A kernel micro-benchmark on [8,128,1536] suggests why:
SimplifiedLayerNormalization is ~0.75x of LayerNormalization, but BiasGelu was far slower than Gelu
(or Add + Gelu) there; that comparison was not confirmed inside MiniLM on the loaded machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

SEQ = 128


def chain_model(hidden: int, inner: int, layers: int, seed: int = 0):
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((hidden, inner)) / np.sqrt(hidden)).astype(np.float32)
        b = (0.1 * rng.standard_normal(inner)).astype(np.float32)
        g = (1 + 0.1 * rng.standard_normal(inner)).astype(np.float32)
        beta = (0.1 * rng.standard_normal(inner)).astype(np.float32)
        inits += [
            numpy_helper.from_array(a, f"l{i}.{n}") for a, n in ((w, "w"), (b, "b"), (g, "g"), (beta, "beta"))
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"l{i}.w"], [f"l{i}.mm"]),
            helper.make_node("Add", [f"l{i}.mm", f"l{i}.b"], [f"l{i}.h"]),
            helper.make_node(
                "LayerNormalization",
                [f"l{i}.h", f"l{i}.g", f"l{i}.beta"],
                [f"l{i}.n"],
                axis=-1,
                epsilon=1e-12,
            ),
            helper.make_node("Gelu", [f"l{i}.n"], [f"l{i}.a"]),
        ]
        x = f"l{i}.a"
        if i + 1 < layers:  # project back to hidden for the next chain
            down = (rng.standard_normal((inner, hidden)) / np.sqrt(inner)).astype(np.float32)
            inits.append(numpy_helper.from_array(down, f"l{i}.down"))
            nodes.append(helper.make_node("MatMul", [x, f"l{i}.down"], [f"l{i}.out"]))
            x = f"l{i}.out"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", inner])],
        initializer=inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def run_pipeline(model, text: str):
    from precast.ir.pipeline import PassManager, parse_pipeline

    pm = PassManager(parse_pipeline(text))
    out = pm.run(model)
    return out, {r.spec: r.stats for r in pm.records if r.stats.get("fused")}


def gemm2d(model):
    """Each rank-3 MatMul(x, W) + Add(b) -> Reshape(x, [-1, K]) -> Gemm(W, b) -> Reshape back to [B, S, N]."""
    import onnx_ir as ir

    g = model.graph
    k = 0
    for add in [n for n in g if n.op_type == "Add"]:
        mm = add.inputs[0].producer()
        if mm is None or mm.op_type != "MatMul" or add.inputs[1].const_value is None:
            continue
        x, w = mm.inputs
        n_out = w.shape[1]

        def c(a, name):
            g.register_initializer(
                ir.Value(
                    name=name,
                    const_value=ir.tensor(np.array(a, np.int64), name=name),
                    shape=ir.Shape([len(a)]),
                    type=ir.TensorType(ir.DataType.INT64),
                )
            )
            return g.initializers[name]

        flat, tail = c([-1, w.shape[0]], f"gemm{k}/flat"), c([n_out], f"gemm{k}/n")
        nodes = [
            ir.Node("", "Reshape", [x, flat], name=f"gemm{k}/reshape_in"),
            ir.Node("", "Shape", [x], [ir.AttrInt64("end", 2)], name=f"gemm{k}/shape"),
        ]
        nodes.append(ir.Node("", "Gemm", [nodes[0].outputs[0], w, add.inputs[1]], name=f"gemm{k}/gemm"))
        nodes.append(
            ir.Node(
                "", "Concat", [nodes[1].outputs[0], tail], [ir.AttrInt64("axis", 0)], name=f"gemm{k}/dims"
            )
        )
        nodes.append(
            ir.Node("", "Reshape", [nodes[2].outputs[0], nodes[3].outputs[0]], name=f"gemm{k}/reshape_out")
        )
        g.insert_before(mm, nodes)
        add.outputs[0].replace_all_uses_with(nodes[-1].outputs[0])
        g.remove([add, mm], safe=True)
        k += 1
    return model


def session(model, threads: int) -> Callable:
    import onnx_ir as ir
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return lambda feeds: sess.run(None, feeds)[0]


def interleaved(runners: dict[str, Callable], feeds: dict, rounds: int, base: str, warmup: int = 3) -> dict:
    """Median ms and median per-round ratio to ``base`` for each runner (rotating order each round)."""
    names = list(runners)
    for _ in range(warmup):
        for n in names:
            runners[n](feeds)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            runners[n](feeds)
            times[n].append(time.perf_counter() - t0)
    return {
        n: (statistics.median(t) * 1e3, statistics.median(a / b for a, b in zip(t, times[base])))
        for n, t in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds", type=int, default=200, help="timed rounds at batch 1 (batch 8 gets a quarter)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--inner", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args(argv)

    from precast.targets.ort_cpu import OrtCpu

    plain = chain_model(args.hidden, args.inner, args.layers)
    before = OrtCpu.default_pipeline  # the pass is opt-in (see the module docstring for why)
    full = before.replace("fuse-gelu,", "fuse-gelu,fuse-matmul-layernorm-gelu,", 1)
    models = {"plain": plain}
    models["precast-before"], _ = run_pipeline(plain, before)
    models["precast"], stats = run_pipeline(plain, full)
    models["+gemm2d"] = gemm2d(run_pipeline(plain, full)[0])
    print("precast fusions:", stats)
    for name, m in models.items():
        print(f"  {name:<15}", " ".join(n.op_type for n in m.graph))
    runners = {n: session(m, args.threads) for n, m in models.items()}
    print(f"load average before: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")
    rows = []
    for b in [int(v) for v in args.batches.split(",")]:
        feeds = {"x": np.random.default_rng(b).standard_normal((b, SEQ, args.hidden)).astype(np.float32)}
        ref = runners["plain"](feeds)
        err = {n: float(np.abs(r(feeds) - ref).max()) for n, r in runners.items()}
        res = interleaved(
            runners, feeds, args.rounds if b == 1 else max(20, args.rounds // 4), "precast-before"
        )
        rows += [(b, n, ms, ratio, err[n]) for n, (ms, ratio) in res.items()]
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"\nMatMul({args.hidden}x{args.inner}) -> LayerNorm -> GeLU x{args.layers}, seq {SEQ}, "
        f"{args.threads} threads, ORT_ENABLE_ALL"
    )
    print(
        f"{'batch':>5}  {'variant':<15} {'median ms':>9}  {'ratio vs before':>15}  {'max|diff| vs plain':>18}"
    )
    for b, n, ms, ratio, e in rows:
        print(f"{b:>5}  {n:<15} {ms:>9.2f}  {ratio:>15.3f}  {e:>18.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
