"""Per-node time of a graph from one ONNX Runtime profile run (``split-stages{by=time}``).

The graph runs as written (optimizations off, so each profiled kernel is one node of the graph), with its
nodes renamed ``precast_node_<i>`` in a copy so that every ``<name>_kernel_time`` event maps back to a
node index. A node ORT does not report (a Constant) costs 0.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

__all__ = ["node_times_us"]

_PREFIX = "precast_node_"


def node_times_us(
    model: ir.Model, feeds: Mapping[str, np.ndarray], runs: int = 3, threads: int = 1
) -> np.ndarray:
    """Microseconds per top-level node (graph order), the median over ``runs`` profiled runs after a warm-up."""
    import onnxruntime as ort

    proto = ir.serde.serialize_model(model)
    for i, node in enumerate(proto.graph.node):
        node.name = f"{_PREFIX}{i}"
    n = len(proto.graph.node)
    with tempfile.TemporaryDirectory(prefix="precast-profile-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        run_feeds = {k: v for k, v in feeds.items() if k in names}
        for _ in range(runs + 1):
            sess.run(None, run_feeds)
        path = sess.end_profiling()
        with open(path) as f:
            events = json.load(f)
    per_run: list[np.ndarray] = []
    current = None
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") != "Node":
            continue
        name = str(ev.get("name", ""))
        if not name.startswith(_PREFIX) or not name.endswith("_kernel_time"):
            continue
        i = int(name[len(_PREFIX) : -len("_kernel_time")])
        if current is None or current[i] > 0:  # a node seen twice: the next run began
            current = np.zeros(n)
            per_run.append(current)
        current[i] = max(float(ev.get("dur", 0)), 1e-3)
    if not per_run:
        return np.zeros(n)
    measured = per_run[1:] if len(per_run) > 1 else per_run  # the first run warms caches
    return np.median(np.stack(measured), axis=0)
