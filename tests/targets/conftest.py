"""Fixtures for hardware-target tests: a tiny MLP on disk and an in-process CLI runner."""

from types import SimpleNamespace

import pytest

from precast.cli.main import main
from tests.helpers import save, tiny_mlp


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    return save(tiny_mlp(), tmp_path_factory.mktemp("src") / "mlp.onnx")


@pytest.fixture
def cli(capsys):
    """Run the precast CLI in-process; returns .code, .out, .err."""

    def run(*args):
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return SimpleNamespace(code=code, out=out, err=err)

    return run


def cosine(a, b) -> float:
    a, b = a.ravel().astype("float64"), b.ravel().astype("float64")
    return float(a @ b / ((a @ a) ** 0.5 * (b @ b) ** 0.5))
