import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.helpers import make_model


@pytest.fixture
def mlp2():
    """x[batch,128] -> fc1 (128x256) -> Relu -> fc2 (256x64) -> y: big enough for 4-bit blocks."""
    rng = np.random.default_rng(0)
    k, h, n = 128, 256, 64
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ]
    inits = {
        "w1": (rng.standard_normal((k, h)) / np.sqrt(k)).astype(np.float32),
        "w2": (rng.standard_normal((h, n)) / np.sqrt(h)).astype(np.float32),
    }
    return make_model(
        nodes, [("x", TensorProto.FLOAT, ["batch", k])], [("y", TensorProto.FLOAT, ["batch", n])], inits
    )


@pytest.fixture
def correlated():
    """Sampler of anisotropic, correlated activations (a few loud channels): where GPTQ beats RTN."""
    mix = np.random.default_rng(7).standard_normal((128, 128)) * (
        np.random.default_rng(8).random(128) ** 4 * 10
    )

    def sample(n: int, seed: int) -> np.ndarray:
        return (np.random.default_rng(seed).standard_normal((n, 128)) @ mix.T).astype(np.float32)

    return sample
