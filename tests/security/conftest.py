"""Fixtures for the server attack tests: the artifacts tests/server builds, a tiny compiled Llama, packs."""

from __future__ import annotations

import pytest

from tests.server.conftest import mlp_a, mlp_b, tiny_encoder  # noqa: F401  (pytest fixtures, reused)


@pytest.fixture(scope="session")
def packed_mlp(mlp_a, tmp_path_factory):  # noqa: F811
    from precast.compiler.pack import pack_artifact

    out = tmp_path_factory.mktemp("packed") / "mlp.precast"
    pack_artifact(mlp_a, out)
    return out
