import pytest

from tests.llm.fixtures import build_gpt2


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return build_gpt2(tmp_path_factory.mktemp("llm") / "tiny-gpt2")
