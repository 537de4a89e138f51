"""Fixtures for hardware-target tests: a tiny MLP on disk (the `cli` runner is in tests/conftest.py)."""

import pytest

from tests.helpers import save, tiny_mlp


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    return save(tiny_mlp(), tmp_path_factory.mktemp("src") / "mlp.onnx")


def cosine(a, b) -> float:
    a, b = a.ravel().astype("float64"), b.ravel().astype("float64")
    return float(a @ b / ((a @ a) ** 0.5 * (b @ b) ** 0.5))
