import pytest

from tests.llm.fixtures import build_gpt2, build_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return build_gpt2(tmp_path_factory.mktemp("llm") / "tiny-gpt2")
