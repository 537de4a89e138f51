import pytest

from tests.llm.fixtures import build_gpt2, build_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return build_gpt2(tmp_path_factory.mktemp("llm") / "tiny-gpt2")


@pytest.fixture(scope="session")
def llama_artifact_mapped(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama compiled for ort-cpu (head size 16: the mapped KV layout)."""
    from precast.compiler.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("art") / "llama-mapped"
    compile_model(str(tiny_llama_dir), out, CompileOptions(targets=("ort-cpu",), task="causal-lm"))
    return out
