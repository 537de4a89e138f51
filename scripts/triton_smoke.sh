#!/usr/bin/env bash
# Smoke test of the `triton` target with the real tritonserver that the nvidia-pytriton wheel bundles
# (Python backend only, CPU). It needs its own virtualenv: pytriton pins numpy 1.26.
#
#   scripts/triton_smoke.sh [ARTIFACT ...]
#
# With no ARTIFACT, a tiny MLP is compiled with `--target triton` first (by the main environment's
# python, which has precast's compiler). The venv (default .cache/triton-venv, gitignored) is made once:
# nvidia-pytriton, tritonclient, onnxruntime, tokenizers; precast itself is reinstalled from this
# working tree on every run (--no-deps: the stub only needs precast.runtime). Triton's Python stub
# embeds the first python3 on tritonserver's PATH, so triton_smoke.py puts the venv's bin/ first.
#
# Env: PRECAST_TRITON_VENV (venv dir), PRECAST_TRITON_PYTHON (interpreter for the venv, default
# python3.11; the wheel ships stubs for 3.8-3.13), PRECAST_PYTHON (main env, default python),
# PRECAST_TRITON_SMOKE_TIMEOUT (seconds for the whole serving part, default 600).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PRECAST_TRITON_VENV:-$ROOT/.cache/triton-venv}"
VENV_PY="${PRECAST_TRITON_PYTHON:-python3.11}"
MAIN_PY="${PRECAST_PYTHON:-python}"
REQS="nvidia-pytriton tritonclient[http,grpc] numpy<2 onnxruntime>=1.22,<1.33 tokenizers>=0.20 setuptools>=68"

log() { echo "[triton-smoke] $*"; }

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one run at a time sets up the shared venv; released before serving
if [ ! -f "$VENV/.precast-ready" ] || [ "$(cat "$VENV/.precast-ready")" != "$REQS" ]; then
  log "creating $VENV"
  rm -rf "$VENV"
  "$VENV_PY" -m venv "$VENV"
  # shellcheck disable=SC2086  # REQS is a list of requirement specifiers
  (set -f; IFS=' '; "$VENV/bin/pip" install -q --disable-pip-version-check $REQS)
  echo "$REQS" > "$VENV/.precast-ready"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/precast-triton-smoke.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# precast from this working tree (a copy: the build must not write into the shared tree).
mkdir -p "$WORK/src"
cp "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/README.md" "$WORK/src/"
# the package folders, as setup.py's FOLDERS lists them ("precast.x": "folder",)
for d in $(sed -n 's/^ *"precast[a-z.]*": "\([a-z_]*\)",$/\1/p' "$ROOT/setup.py"); do
  cp -r "$ROOT/$d" "$WORK/src/$d"
done
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall "$WORK/src"
flock -u 9

if [ "$#" -eq 0 ]; then
  log "compiling a tiny MLP with --target triton"
  (cd "$ROOT" && "$MAIN_PY" -c "from tests.helpers import save, tiny_mlp; save(tiny_mlp(), '$WORK/mlp.onnx')")
  (cd "$ROOT" && "$MAIN_PY" -c "import sys; from precast.cli.main import main; main(sys.argv[1:])" \
      compile "$WORK/mlp.onnx" -o "$WORK/mlp-triton" -t triton -q \
      --target-option model_name=mlp --target-option preferred_batch_sizes=4,8 \
      --target-option max_queue_delay_us=2000)
  set -- "$WORK/mlp-triton"
fi

timeout --kill-after=20 "${PRECAST_TRITON_SMOKE_TIMEOUT:-600}" \
  "$VENV/bin/python" "$ROOT/scripts/triton_smoke.py" ${PRECAST_TRITON_SMOKE_JSON:+--json "$PRECAST_TRITON_SMOKE_JSON"} "$@"
