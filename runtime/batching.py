"""Merge-or-rerun batching: compatible requests run as one model call, and a failed call is retried per request.

    feeds of n requests --RowMerge.join--> one batch --run--> outputs --RowMerge.split--> n results
                              \\ (the merged run raised) --> each request alone --> its outputs or its own error

The one exception policy, for every caller (the server's batcher, the stage pipeline, the Triton Python models):
- Any ``Exception`` from joining, running or splitting a merged batch reruns its requests one by one, so one bad
  request fails alone and its neighbours still get their outputs. A batch of one request is not rerun: the
  error is its result.
- A request's error is *its result*: ``run_merged`` returns a list of outputs-or-exception, one per request,
  and never raises an ``Exception``. ``blame`` turns a raw error into the one the caller reports (e.g. an
  InputError naming the stage that rejected the feeds).
- A ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt, SystemExit) is not a request's fault:
  it propagates, and the caller fails the whole batch with it.

Merging is along dim 0. Requests merge when their inputs agree in names, dtypes and every dim past the first
(``RowMerge.key``); a rule with ``pad`` (token inputs of different lengths) also lets dim 1 differ: those
inputs are right-padded to the longest, and outputs of that length are cropped back per request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError

__all__ = [
    "ROWS",
    "Feeds",
    "Outputs",
    "Result",
    "RowMerge",
    "rerun_alone",
    "run_merged",
    "shared_leading_dim",
]

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
Result = Outputs | Exception  # one request's outputs, or its own error


@dataclass(frozen=True)
class RowMerge:
    """How requests merge along dim 0 and split back; ``pad``: input name -> pad value along dim 1 (or None)."""

    pad: Mapping[str, int] | None = None

    def key(self, feeds: Feeds) -> Hashable | None:
        """Requests with equal keys merge; None: this request merges with no other (an input without rows)."""
        tail = 1 if self.pad is None else 2
        if any(not isinstance(a, np.ndarray) or a.ndim < tail for a in feeds.values()):
            return None
        return (
            self.pad is not None,
            tuple((n, a.dtype.str, a.shape[tail:]) for n, a in sorted(feeds.items())),
        )

    def rows(self, feeds: Feeds) -> int:
        """A request's rows: dim 0 of its first input that has dims (1 if none has)."""
        first = next((a for a in feeds.values() if isinstance(a, np.ndarray) and a.ndim), None)
        return int(first.shape[0]) if first is not None else 1

    def join(self, feeds: Sequence[Feeds]) -> dict[str, np.ndarray]:
        """One batch of ``feeds`` (a new dict: callers may change it); padded inputs to the longest length."""
        if len(feeds) == 1 and self.pad is None:
            return dict(feeds[0])
        longest = max(self._length(f) for f in feeds)
        merged = {}
        for name in feeds[0]:
            parts = [f[name] for f in feeds]
            if self.pad is not None and name in self.pad:
                parts = [_pad_axis1(p, longest, self.pad[name]) for p in parts]
            merged[name] = np.concatenate(parts, axis=0)
        return merged

    def split(self, outputs: Mapping[str, np.ndarray], feeds: Sequence[Feeds]) -> list[Outputs]:
        """``outputs`` of the joined batch, back as one dict per request (InputError if an output has no rows
        to split); a padded request's outputs of the padded length are cropped to its own."""
        if len(feeds) == 1 and self.pad is None:
            return [dict(outputs)]
        sizes = [self.rows(f) for f in feeds]
        lengths = [self._length(f) for f in feeds]
        total, longest = sum(sizes), max(lengths)
        for name, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                raise InputError(
                    f"output '{name}' has leading dim {arr.shape[:1]}, cannot split a batch of {total}"
                )
        results, start = [], 0
        for rows, length in zip(sizes, lengths):
            res = {}
            for name, arr in outputs.items():
                part = arr[start : start + rows]
                if self.pad is not None and part.ndim >= 2 and part.shape[1] == longest:
                    part = part[:, :length]
                res[name] = part
            results.append(res)
            start += rows
        return results

    def _length(self, feeds: Feeds) -> int:
        return next(iter(feeds.values())).shape[1] if self.pad is not None else 0


ROWS = RowMerge()  # plain concatenation along dim 0, no padding


def _same(error: Exception) -> Exception:
    return error


def run_merged(
    feeds: Sequence[Feeds],
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    *,
    rule: RowMerge = ROWS,
    alone: Callable[[Feeds], Outputs] | None = None,
    blame: Callable[[Exception], Exception] | None = None,
) -> list[Result]:
    """Run ``feeds`` (requests ``rule`` lets merge) as one call of ``run`` and split the outputs back; if that
    raises, rerun each request alone (``alone``; default: ``run`` on that request's own batch). One result per
    request, in order: its outputs, or its error through ``blame`` (the policy in this module's docstring)."""
    try:
        return rule.split(run(rule.join(feeds)), feeds)
    except Exception as error:  # noqa: BLE001 - reported per request, below
        return rerun_alone(feeds, error, alone or (lambda f: rule.split(run(rule.join([f])), [f])[0]), blame)


def rerun_alone(
    feeds: Sequence[Feeds],
    error: Exception,
    alone: Callable[[Feeds], Outputs],
    blame: Callable[[Exception], Exception] | None = None,
) -> list[Result]:
    """The results of requests whose merged run raised ``error``: that error alone (one request), else each
    request run by ``alone``, so only the bad one fails. For callers whose merged run is not one call (the
    stage pipeline runs it stage by stage on its workers); ``run_merged`` ends here too. ``blame``: None keeps
    each error as it was raised."""
    blame = blame or _same
    if len(feeds) == 1:
        return [blame(error)]
    results: list[Result] = []
    for f in feeds:
        try:
            results.append(alone(f))
        except Exception as e:  # noqa: BLE001 - this request's own error, its result
            results.append(blame(e))
    return results


def shared_leading_dim(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str | None:
    """The symbolic leading dim every input and output shares, or None: only such a model can merge requests."""
    specs = [*inputs, *outputs]
    if not specs or any(not s.shape for s in specs):
        return None
    first = {s.shape[0] for s in specs}
    dim = first.pop() if len(first) == 1 else None
    return dim if isinstance(dim, str) else None


def _pad_axis1(a: np.ndarray, length: int, value: int) -> np.ndarray:
    if a.shape[1] == length:
        return a
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, length - a.shape[1])
    return np.pad(a, widths, constant_values=value)
