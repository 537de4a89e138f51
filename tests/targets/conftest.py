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
    from precast.compiler import isolated

    root = str(Path(__file__).resolve().parents[2])  # the child imports tests.targets.crash_entries
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))

    def use(entry: str, func: str) -> None:
        assert entry in isolated.ENTRIES
        monkeypatch.setitem(isolated.ENTRIES, entry, f"tests.targets.crash_entries:{func}")

    return use
