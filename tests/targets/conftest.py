"""Fixtures for hardware-target tests: a tiny MLP on disk (the `cli` runner is in tests/conftest.py)."""

import os
from pathlib import Path

import pytest

from tests.helpers import save, tiny_mlp


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    return save(tiny_mlp(), tmp_path_factory.mktemp("src") / "mlp.onnx")


def cosine(a, b) -> float:
    a, b = a.ravel().astype("float64"), b.ravel().astype("float64")
    return float(a @ b / ((a @ a) ** 0.5 * (b @ b) ** 0.5))


@pytest.fixture
def child_entry(monkeypatch):
    """Point one of precast's isolated (child-process) entries at tests/targets/crash_entries.py."""
    from precast.targets import isolated

    root = str(Path(__file__).resolve().parents[2])  # the child imports tests.targets.crash_entries
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))

    def use(entry: str, func: str) -> None:
        assert entry in isolated.ENTRIES
        monkeypatch.setitem(isolated.ENTRIES, entry, f"tests.targets.crash_entries:{func}")

    return use


# Held-out sentences for MiniLM parity: none of them is in precast's calibration or sample sentences.
EVAL_SENTENCES = (
    "A woman is slicing tomatoes in the kitchen.",
    "The new smartphone has a larger battery and a better camera.",
    "Where can I find cheap flights to Tokyo in April?",
    "The doctor advised him to get more sleep and exercise regularly.",
    "Heavy rain caused flooding in several villages along the river.",
    "I would like to cancel my subscription, please.",
    "The orchestra performed Beethoven's ninth symphony last night.",
    "Two dogs are running through a field of tall grass.",
)


@pytest.fixture(scope="session")
def minilm_multi(minilm_dir, tmp_path_factory):
    """all-MiniLM-L6-v2 (real weights) compiled once for ort-cpu + ort-qnn with sequence buckets 64 and 128,
    batch 1, the default budget (~150 s)."""
    pytest.importorskip("onnxruntime_qnn")
    from precast.compiler.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("minilm") / "art"
    opts = CompileOptions(
        targets=["ort-cpu", "ort-qnn"], dims={"batch": 1}, target_options={"buckets": "64,128"}
    )
    result = compile_model(str(minilm_dir), out, opts)
    return out, result
