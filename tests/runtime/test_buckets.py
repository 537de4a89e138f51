"""runtime/buckets.py with stand-in sessions: the smallest bucket that fits runs, padded, outputs sliced back."""

import numpy as np
import pytest

from precast.errors import ArtifactError, InputError
from precast.runtime.buckets import (
    BucketedSession,
    bucket_shapes,
    pad_to,
    parse_buckets,
)


class Echo:
    """A static-shape session: y = ids * mask (so padding shows as zeros), and the size it ran at."""

    def __init__(self, size):
        self.size = size

    def get_providers(self):
        return ["Fake"]

    def run(self, names, feeds):
        assert feeds["ids"].shape == (1, self.size) and feeds["mask"].shape == (1, self.size)
        return [feeds["ids"] * feeds["mask"], np.array([self.size])][: len(names)]


@pytest.fixture
def session():
    return BucketedSession({128: Echo(128), 64: Echo(64)}, {"ids": 1, "mask": 1}, {"y": 1})


def test_smallest_bucket_that_fits_runs_and_outputs_are_sliced_back(session):
    ids = np.arange(1, 21)[None, :]
    y, size = session.run(["y", "size"], {"ids": ids, "mask": np.ones_like(ids)})
    assert session.last_bucket == 64 and int(size[0]) == 64
    np.testing.assert_array_equal(y, ids)  # 20 values, not 64


def test_exact_fit_and_next_bucket(session):
    for n, bucket in ((64, 64), (65, 128), (128, 128)):
        ids = np.ones((1, n), np.int64)
        session.run(["y"], {"ids": ids, "mask": ids})
        assert session.last_bucket == bucket


def test_longer_than_the_largest_bucket_is_one_line_naming_it(session):
    ids = np.ones((1, 129), np.int64)
    with pytest.raises(
        InputError, match=r"^sequence length 129 is longer than this artifact's largest bucket \(128\)"
    ):
        session.run(["y"], {"ids": ids, "mask": ids})


def test_inputs_that_disagree_on_the_length(session):
    with pytest.raises(InputError, match="disagree"):
        session.run(["y"], {"ids": np.ones((1, 5), np.int64), "mask": np.ones((1, 6), np.int64)})


def test_pad_to_pads_with_zeros_and_cuts():
    a = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(pad_to(a, 1, 5), [[1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(pad_to(a, 1, 2), [[1, 2]])


def test_bucket_shapes_and_malformed_blocks():
    block = {"sizes": [64, 128], "models": {"64": "a.onnx", "128": "b.onnx"}, "inputs": {"ids": 1}}
    assert bucket_shapes({"ids": [1, 128], "other": [3]}, block, 64) == {"ids": [1, 64], "other": [3]}
    with pytest.raises(ArtifactError, match="one model per size"):
        parse_buckets({**block, "models": {"64": "a.onnx"}})
    with pytest.raises(ArtifactError, match="malformed 'buckets'"):
        parse_buckets({"sizes": "x"})


def test_length_zero_is_one_line(session):
    empty = np.ones((1, 0), np.int64)
    with pytest.raises(InputError, match=r"^the bucketed inputs have sequence length 0: nothing to run$"):
        session.run(["y"], {"ids": empty, "mask": empty})  # was: the 64 bucket's answer to all padding


class BatchOne(Echo):
    """Echo with the static shapes a PluginSession records (batch 1, as ort-qnn compiles by default)."""

    def __init__(self, size):
        super().__init__(size)
        self.static_shapes = {"ids": (1, size), "mask": (1, size)}


def test_more_rows_than_the_compiled_batch_run_one_at_a_time():
    s = BucketedSession({64: BatchOne(64), 128: BatchOne(128)}, {"ids": 1, "mask": 1}, {"y": 1})
    ids = np.arange(1, 31).reshape(3, 10)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # a padded row keeps its zeros
    y, size = s.run(["y", "size"], {"ids": ids, "mask": mask})  # Echo asserts batch 1 per call
    np.testing.assert_array_equal(y, ids * mask)
    assert size.tolist() == [64, 64, 64] and s.last_bucket == 64
