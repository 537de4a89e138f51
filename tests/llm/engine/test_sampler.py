import numpy as np
import pytest

from precast.errors import LLMRequestError
from precast.runtime.llm.sampler import SamplingParams, filtered_probs, sample


@pytest.fixture
def logits():
    return np.random.default_rng(3).standard_normal(50).astype(np.float32) * 2


def _draws(logits, params, n=200, history=()):
    rng = np.random.default_rng(params.seed)
    return [sample(logits, params, list(history), rng) for _ in range(n)]


def test_greedy_is_argmax(logits):
    assert sample(logits, SamplingParams(), [], np.random.default_rng()) == int(np.argmax(logits))


def test_seeded_draws_are_reproducible(logits):
    p = SamplingParams(temperature=0.9, seed=11)
    assert _draws(logits, p) == _draws(logits, p)
    assert _draws(logits, p) != _draws(logits, SamplingParams(temperature=0.9, seed=12))


def test_top_k_support(logits):
    p = SamplingParams(temperature=1.5, top_k=5, seed=0)
    assert set(_draws(logits, p, 500)) <= set(np.argsort(-logits)[:5].tolist())
    assert np.count_nonzero(filtered_probs(logits, p)) == 5


def test_top_p_support_is_smallest_head_reaching_p(logits):
    p = SamplingParams(temperature=4.0, top_p=0.6, seed=0)
    probs = np.exp((logits - logits.max()) / 4.0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    k = int(np.searchsorted(np.cumsum(probs[order]), 0.6) + 1)
    expected = set(order[:k].tolist())
    assert set(np.flatnonzero(filtered_probs(logits, p)).tolist()) == expected
    assert set(_draws(logits, p, 500)) <= expected
    assert k > 2 and np.cumsum(probs[order])[k - 2] < 0.6 <= np.cumsum(probs[order])[k - 1]


def test_sample_frequencies_follow_probabilities(logits):
    p = SamplingParams(temperature=1.0, top_k=3, seed=5)
    counts = np.bincount(_draws(logits, p, 4000), minlength=50) / 4000
    np.testing.assert_allclose(counts, filtered_probs(logits, p), atol=0.03)


def test_repetition_penalty_demotes_seen_tokens():
    logits = np.array([2.0, 1.9, -1.0, -1.1], np.float32)
    assert sample(logits, SamplingParams(repetition_penalty=1.5), [0], None) == 1
    # negative logits are pushed further down (x * penalty), not up
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0), [2])
    assert probs[2] < probs[3]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -1.0},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"repetition_penalty": 0.0},
        {"stop": ("",)},
    ],
)
def test_bad_params_are_typed_errors(bad):
    with pytest.raises(LLMRequestError, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad).validate()


def test_min_p_keeps_tokens_within_a_fraction_of_the_top_one():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.12, 0, 0]) / 0.92)
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))  # only the top token
    np.testing.assert_allclose(p, [1, 0, 0, 0, 0])
    for bad in (-0.1, 1.5, "0.1", True):
        with pytest.raises(LLMRequestError, match="min_p"):
            SamplingParams(min_p=bad).validate()
