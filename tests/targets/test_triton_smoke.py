"""The real tritonserver (bundled in the nvidia-pytriton wheel) serves triton-target artifacts.

Runs scripts/triton_smoke.sh on a tiny MLP, the same MLP staged (split-stages{n=2}: an ensemble of two stage
models), a masked layer stack in three stages (int64 input, a tensor passed through a stage) and a tiny
Llama artifact, all in one tritonserver: Triton's Python backend loads each artifact
(each stage) with precast.runtime and answers real HTTP requests on loopback, which are checked against
precast run locally, and the ensemble's answers against the unsplit MLP's; the server is always stopped. It needs the script's own virtualenv
(.cache/triton-venv; pytriton pins numpy 1.26): creating it downloads and installs for ~1.5 minutes,
so the test runs when the venv is already there, or when PRECAST_TRITON_SMOKE=1 lets it build one.
PRECAST_TRITON_SMOKE=0 skips it always.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.targets.triton_fixtures import (
    llama_triton,
    mlp_triton,
    staged_masked_triton,
    staged_mlp_triton,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "triton_smoke.sh"
VENV = Path(os.environ.get("PRECAST_TRITON_VENV", ROOT / ".cache" / "triton-venv"))
PYTHON = os.environ.get("PRECAST_TRITON_PYTHON", "python3.11")

pytestmark = pytest.mark.slow


def _skip_reason() -> str | None:
    flag = os.environ.get("PRECAST_TRITON_SMOKE")
    if flag == "0":
        return "PRECAST_TRITON_SMOKE=0"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "the nvidia-pytriton wheel's tritonserver is Linux x86_64 only"
    if shutil.which(PYTHON) is None:
        return f"no {PYTHON} for the Triton virtualenv (set PRECAST_TRITON_PYTHON)"
    if flag != "1" and not (VENV / ".precast-ready").is_file():
        return (
            f"no Triton virtualenv at {VENV} (creating it takes ~1.5 min of installs): "
            "set PRECAST_TRITON_SMOKE=1 or run scripts/triton_smoke.sh once"
        )
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_tritonserver_serves_precast_artifacts(tmp_path_factory, tmp_path):
    batching = {"preferred_batch_sizes": "4,8", "max_queue_delay_us": "2000"}
    mlp = mlp_triton(tmp_path_factory, **batching)
    staged = staged_mlp_triton(tmp_path_factory, **batching)
    masked = staged_masked_triton(tmp_path_factory, **batching)
    llama = llama_triton(tmp_path_factory)
    results = tmp_path / "results.json"
    env = {**os.environ, "PRECAST_TRITON_SMOKE_JSON": str(results), "PRECAST_TRITON_SMOKE_TIMEOUT": "300"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(mlp), str(staged), str(masked), str(llama)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900 if not (VENV / ".precast-ready").is_file() else 420,
    )
    log = "\n".join(
        line for line in (proc.stdout + proc.stderr).splitlines() if "Location 'file:" not in line
    )
    assert proc.returncode == 0, log[-6000:]
    assert "[triton-smoke] all ok" in proc.stdout
    by_model = {r["model"]: r for r in json.loads(results.read_text())}
    assert by_model["mlp_precast"]["max_abs_error"] <= 1e-4
    # The dynamic batcher stacked concurrent requests: fewer model executions than inferences.
    assert by_model["mlp_precast"]["execution_count"] < by_model["mlp_precast"]["inference_count"]
    assert by_model["llama_precast"]["streams"] == 3 and by_model["llama_precast"]["tokens"] > 0
    # The ensemble: the parity sample and 24 concurrent requests == precast's staged run; every row went
    # through both stage models, whose own dynamic batchers stacked requests; it answers as the unsplit model.
    ensemble = by_model["mlp_staged"]
    assert ensemble["max_abs_error"] <= 1e-4
    assert ensemble["inference_count"] == by_model["mlp_precast"]["inference_count"]  # the same rows
    assert set(ensemble["stages"]) == {"mlp_staged_stage_0", "mlp_staged_stage_1"}
    for counts in ensemble["stages"].values():
        assert counts["inference_count"] == ensemble["inference_count"]
        assert counts["execution_count"] < counts["inference_count"]
    assert ensemble["same_as_unsplit"]["unsplit"] == "mlp_precast"
    assert ensemble["same_as_unsplit"]["max_abs_diff"] <= 1e-5
    masked_result = by_model["masked"]
    assert masked_result["max_abs_error"] <= 1e-4 and len(masked_result["stages"]) == 3
    assert {c["inference_count"] for c in masked_result["stages"].values()} == {
        masked_result["inference_count"]
    }
