"""Fixtures for the server attack tests: the artifacts tests/server builds, a tiny compiled Llama, packs."""

from __future__ import annotations

import pytest

from tests.server.conftest import mlp_a, mlp_b, tiny_encoder  # noqa: F401  (pytest fixtures, reused)


@pytest.fixture(scope="session")
def llm_artifact(tmp_path_factory):
    """A compiled tiny Llama (torch export, ~10 s once per session)."""
    pytest.importorskip("transformers")
    from tests.llm.fixtures import build_llama
    from tests.llm.test_causal_lm import compile_llm

    folder = build_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return compile_llm(folder, tmp_path_factory.mktemp("art") / "llama").output


@pytest.fixture(scope="session")
def packed_mlp(mlp_a, tmp_path_factory):  # noqa: F811
    from precast.compiler.pack import pack_artifact

    out = tmp_path_factory.mktemp("packed") / "mlp.precast"
    pack_artifact(mlp_a, out)
    return out
