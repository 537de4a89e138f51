"""runtime/batching.py: run_merged's one merge-or-rerun policy, on a fake run (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError
from precast.runtime.batching import (
    ROWS,
    RowMerge,
    rerun_alone,
    run_merged,
    shared_leading_dim,
)


def double(feeds):
    """A model: y = 2x; rejects any negative input (a 'bad request' in a merged batch fails the call)."""
    if (feeds["x"] < 0).any():
        raise ValueError("negative input")
    return {"y": feeds["x"] * 2}


def rows(*values, width=3):
    """One request: a row of ``width`` copies of each value."""
    return {"x": np.repeat(np.array(values, np.float32)[:, None], width, axis=1)}


def test_compatible_requests_run_as_one_call_and_split_back():
    calls = []
    feeds = [rows(1), rows(2, 3), rows(4)]
    results = run_merged(feeds, lambda f: (calls.append(f["x"].shape), double(f))[1])
    assert calls == [(4, 3)]
    for f, r in zip(feeds, results):
        np.testing.assert_array_equal(r["y"], f["x"] * 2)


def test_a_bad_request_fails_alone_and_blame_names_it():
    feeds = [rows(1), rows(-1), rows(2)]
    results = run_merged(feeds, double, blame=lambda e: InputError(f"rejected: {e}"))
    np.testing.assert_array_equal(results[0]["y"], feeds[0]["x"] * 2)
    assert isinstance(results[1], InputError) and str(results[1]) == "rejected: negative input"
    np.testing.assert_array_equal(results[2]["y"], feeds[2]["x"] * 2)


def test_a_lone_request_is_not_rerun():
    calls = []

    def failing(f):
        calls.append(1)
        raise ValueError("no")

    (result,) = run_merged([rows(1)], failing)
    assert isinstance(result, ValueError) and calls == [1]
    (error,) = rerun_alone([rows(1)], KeyError("k"), failing)  # what run_merged does after its one call
    assert isinstance(error, KeyError) and calls == [1]


def test_base_exceptions_fail_the_whole_batch():
    def interrupted(f):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_merged([rows(1), rows(2)], interrupted)


def test_outputs_without_rows_are_rerun_request_by_request():
    seen = []

    def total(f):
        seen.append(f["x"].shape[0])
        return {"s": np.float32(f["x"].sum())}  # no leading dim: a merged batch cannot split

    results = run_merged([rows(1), rows(2)], total)
    assert seen == [2, 1, 1] and [float(r["s"]) for r in results] == [3.0, 6.0]


def test_padded_requests_merge_across_lengths_and_are_cropped_back():
    rule = RowMerge(pad={"ids": 0})
    a = {"ids": np.array([[1, 2, 3]], np.int64)}
    b = {"ids": np.array([[4]], np.int64)}
    assert rule.key(a) == rule.key(b) and ROWS.key(a) != ROWS.key(b)
    merged = rule.join([a, b])
    np.testing.assert_array_equal(merged["ids"], [[1, 2, 3], [4, 0, 0]])
    out = run_merged([a, b], lambda f: {"h": f["ids"] * 10}, rule=rule)
    np.testing.assert_array_equal(out[1]["h"], [[40]])


def test_keys_refuse_what_cannot_merge():
    assert ROWS.key({"x": np.float32(1.0)}) is None  # no rows
    assert ROWS.key(rows(1)) != ROWS.key(rows(1, width=4))
    assert ROWS.key(rows(1)) != ROWS.key({"x": rows(1)["x"].astype(np.float64)})
    assert ROWS.rows({"s": np.float32(1), "x": np.zeros((5, 2))}) == 5


def test_shared_leading_dim():
    spec = lambda name, shape: TensorSpec(name, "float32", shape)  # noqa: E731
    assert shared_leading_dim([spec("x", ["batch", 3])], [spec("y", ["batch"])]) == "batch"
    assert shared_leading_dim([spec("x", ["batch", 3])], [spec("y", ["n"])]) is None
    assert shared_leading_dim([spec("x", [2, 3])], [spec("y", [2])]) is None
