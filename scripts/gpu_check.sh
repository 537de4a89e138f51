#!/usr/bin/env bash
# GPU checks in one go, for a machine with an NVIDIA GPU and TensorRT (pip install -e '.[tensorrt,dev]'):
#   1. the GPU check the runtime does (CUDA driver, compute capability, TensorRT import),
#   2. the pytest tests marked `gpu`,
#   3. a small engine build end to end: compile tiny MLP -> tensorrt engine -> load -> parity vs ONNX Runtime,
#      plus the build-plan path: a plan built with --target tensorrt on this host is turned into an engine
#      by its own build_engine.py and re-verified with `precast verify`.
# Exit status is non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "== 1. host"
python - <<'PY'
from precast.runtime.backends.tensorrt import gpu_info, tensorrt_available
ok, why, cc = gpu_info()
print(f"gpu: {ok} {why} compute capability {cc}")
ok2, why2 = tensorrt_available()
print(f"tensorrt: {ok2} {why2}")
if ok2:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
raise SystemExit(0 if ok and ok2 else 3)
PY

echo "== 2. pytest -m gpu"
python -m pytest -q -m gpu tests

echo "== 3. engine build + parity"
python - "$WORK" <<'PY'
import json, subprocess, sys
from pathlib import Path
import numpy as np
from precast.compiler.driver import CompileOptions, compile_model
from precast.runtime import load
from tests.helpers import ort_run, save, tiny_mlp

work = Path(sys.argv[1])
src = save(tiny_mlp(), work / "mlp.onnx")
for precision in ("fp32", "fp16"):
    out = work / f"engine-{precision}"
    r = compile_model(str(src), out, CompileOptions(targets=["tensorrt"],
                      target_options={"profile": "batch=1::32", "precision": precision}), progress=print)
    block = r.manifest["target"]
    assert block["backend"] == "tensorrt", block
    print(precision, "engine:", block["tensorrt_version"], "sm", block["compute_capability"], r.manifest["parity"]["outputs"])
    x = np.random.default_rng(1).standard_normal((17, 8)).astype(np.float32)
    got, want = load(out).run({"x": x})["y"], ort_run(tiny_mlp(), {"x": x})[0]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"{precision}: batch 17 max rel-to-range error {err:.2e}")
    assert err < (1e-4 if precision == "fp32" else 2e-2)

# Multi-target selection on a GPU host picks the engine.
multi = work / "multi"
compile_model(str(src), multi, CompileOptions(targets=["ort-cpu", "tensorrt"]))
m = load(multi)
assert m.target == "tensorrt" and m.skipped == {}, (m.target, m.skipped)
print("multi-target load picked", m.target)
PY

echo "== 4. build plan -> build_engine.py -> precast verify"
python - "$WORK" <<'PY'
import json, shutil, sys
from pathlib import Path
from precast.compiler.driver import CompileOptions, compile_model
from precast.targets import tensorrt_target
from tests.helpers import save, tiny_mlp

work = Path(sys.argv[1])
# Force the plan path even on this GPU host, as a CPU-only CI machine would produce it.
tensorrt_target.tensorrt_available = lambda: (False, "forced plan for gpu_check.sh")
compile_model(str(save(tiny_mlp(), work / "mlp2.onnx")), work / "plan", CompileOptions(targets=["tensorrt"]))
print(json.loads((work / "plan" / "manifest.json").read_text())["target"]["backend"])
PY
python "$WORK/plan/build_engine.py" "$WORK/plan" "$WORK/from-plan" --timing-cache "$WORK/timing.cache"
precast verify "$WORK/from-plan"
test -s "$WORK/timing.cache"
echo "gpu_check: all passed"
