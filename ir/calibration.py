"""Calibration data: read ``--calibration DATA`` and hand feeds to ONNX Runtime's quantizers.

    feeds.npz  with keys 'input_ids', 'attention_mask'        -> one feeds dict (one batch)
    feeds.npz  with keys '0/input_ids', '1/input_ids', ...    -> one feeds dict per prefix
    text.txt                                                  -> PassContext.calibration_text (LLMs; a causal-lm
                                                                 step graph calibrates on it as prefill steps)

A pass asks ``calibration_batches(context, inputs)`` for feeds checked against the model's inputs (and reports
``used_user_data`` in its facts);
without --calibration data it calibrates on built-in sentences when the source ships a tokenizer.json and the
model takes text (input_ids / attention_mask / token_type_ids): tokenized, padded to the model's (or the sample
feeds') sequence length, in batches of its batch size -- real padded text, whose masked positions and token
statistics random ids lack. Otherwise it falls back to the sample feeds. Its stats say which.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from precast.artifact.manifest import TensorSpec
from precast.errors import InputError, UsageError, first_line
from precast.ir.registry import PassContext
from precast.runtime.feeds import check_feeds
from precast.runtime.progress import SILENT, ProgressReporter

__all__ = [
    "load_calibration",
    "calibration_batches",
    "used_user_data",
    "text_feeds",
    "CALIBRATION_SENTENCES",
    "FeedsReader",
]

# The sources of calibration_batches that are the user's --calibration data (feeds, or text as prefill steps)
USER_DATA = frozenset({"calibration", "calibration-text"})


def load_calibration(path: str | Path) -> tuple[list[dict[str, np.ndarray]] | None, str | None]:
    """(feeds list, None) for an .npz, (None, text) for a .txt."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"calibration file not found: {path}")
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise InputError(f"calibration text {path} is empty")
        return None, text
    if path.suffix != ".npz":
        raise UsageError(f"--calibration {path}: expected an .npz of feeds or a .txt file")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a readable .npz of arrays ({first_line(e)})") from e
    if not arrays:
        raise InputError(f"calibration file {path} holds no arrays")
    prefixed = [k for k in arrays if "/" in k]
    if not prefixed:
        return [arrays], None
    if len(prefixed) != len(arrays):
        plain = sorted(set(arrays) - set(prefixed))[0]
        raise InputError(f"{path}: key '{plain}' has no 'N/' batch prefix while others do; use one style")
    batches: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        idx, _, name = key.partition("/")
        batches.setdefault(idx, {})[name] = arr
    order = sorted(batches, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    return [batches[i] for i in order], None


# Calibration text for encoders with a tokenizer (none of it is in the tests' evaluation sentences).
CALIBRATION_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on a small stage while the audience sings along.",
    "Interest rates were raised again to fight inflation.",
    "How do I reset my password if I no longer have access to my email account?",
    "The committee postponed its decision until next month.",
    "She baked a chocolate cake for her grandmother's birthday.",
    "Scientists discovered a new species of frog in the rainforest.",
    "Please send me the report by Friday afternoon.",
    "The train to Berlin was delayed by two hours because of snow.",
    "Machine learning models need large amounts of labelled data.",
    "What is the best way to learn a new language quickly?",
    "The stock market fell sharply after the announcement.",
    "Children were playing football in the park until sunset.",
    "He forgot his umbrella and got soaked on the way home.",
    "The museum opens at nine and closes at five on weekdays.",
    "Our flight was cancelled, so we booked a hotel near the airport.",
)
_TEXT_INPUTS = {"input_ids", "attention_mask", "token_type_ids"}


def text_feeds(
    folder: str | Path | None,
    shapes: dict[str, Sequence[int]],
    sentences: Sequence[str] = CALIBRATION_SENTENCES,
) -> list[dict[str, np.ndarray]] | None:
    """``sentences`` tokenized with ``folder``'s tokenizer.json, each batch [batch, seq] as ``shapes`` says
    (padded / truncated to seq); None when there is no tokenizer or the inputs are not text inputs."""
    if folder is None or not shapes or not set(shapes) <= _TEXT_INPUTS or "input_ids" not in shapes:
        return None
    tok_file = Path(folder) / "tokenizer.json"
    dims = {tuple(int(d) for d in s) for s in shapes.values()}
    if not tok_file.is_file() or len(dims) != 1 or len(next(iter(dims))) != 2:
        return None
    batch, seq = next(iter(dims))
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
    except Exception:  # no tokenizers, or a file it cannot read: not text we can make
        return None
    tok.enable_padding(length=seq)
    tok.enable_truncation(max_length=seq)
    enc = tok.encode_batch(list(sentences))
    columns = {
        "input_ids": [e.ids for e in enc],
        "attention_mask": [e.attention_mask for e in enc],
        "token_type_ids": [e.type_ids for e in enc],
    }
    rows = {name: np.array(columns[name], dtype=np.int64) for name in shapes}
    n = max(1, len(sentences) // batch)
    picks = [[(b * batch + i) % len(sentences) for i in range(batch)] for b in range(n)]
    return [{name: arr[p] for name, arr in rows.items()} for p in picks]


def calibration_batches(
    context: PassContext, inputs: Sequence[TensorSpec]
) -> tuple[list[dict[str, np.ndarray]], str]:
    """The feeds a quantizer calibrates on and where they came from ('calibration' or 'sample-feeds')."""
    feeds = context.calibration_feeds
    source = "calibration"
    text = context.calibration_text
    if not feeds and text:
        from precast.ir.llm_text import is_step_graph, step_calibration_feeds

        if is_step_graph(inputs):  # a causal-lm step graph: the text, tokenized, as prefill steps
            feeds, source = (
                step_calibration_feeds(text, context.source_dir, inputs),
                "calibration-text",
            )
    sample = context.sample_feeds
    if not feeds:
        feeds = text_feeds(context.source_dir, _static_shapes(inputs, sample))
        source = "calibration-sentences"
    if not feeds:
        if not sample:
            raise UsageError("this pass needs calibration data: pass --calibration feeds.npz")
        feeds, source = [sample, *_padded_copy(sample)], "sample-feeds"
    checked = []
    for i, batch in enumerate(feeds):
        try:
            checked.append(check_feeds(batch, inputs))
        except InputError as e:
            raise InputError(f"calibration batch {i}: {e}") from e
    return checked, source


def used_user_data(source: str | None) -> bool:
    """Whether ``source`` (``calibration_batches``'; a pass's ``calibration`` stat) is the user's --calibration
    data: the driver warns when --calibration was given and no pass or target used it."""
    return source in USER_DATA


def _padded_copy(sample: dict) -> list[dict[str, np.ndarray]]:
    """[the sample feeds with the trailing half of each attention_mask row 0] (or [] without such a mask).

    Generated sample masks are all ones: calibrated on them alone, the attention-mask fill never shows in
    the activation ranges (a zero-width range, which QNN's HTP finalize refuses; elsewhere a clipped fill)."""
    mask = sample.get("attention_mask")
    if mask is None or np.ndim(mask) != 2 or np.shape(mask)[1] < 2 or not np.all(np.asarray(mask) == 1):
        return []
    padded = np.array(mask, copy=True)
    padded[:, (padded.shape[1] + 1) // 2 :] = 0
    return [{**sample, "attention_mask": padded}]


def _static_shapes(inputs: Sequence[TensorSpec], sample: dict | None) -> dict[str, tuple[int, ...]]:
    """Each input's shape: its own when static, else its sample feed's ({} when one has neither)."""
    shapes = {}
    for spec in inputs:
        if spec.shape is not None and all(isinstance(d, int) for d in spec.shape):
            shapes[spec.name] = tuple(spec.shape)
        elif sample is not None and spec.name in sample:
            shapes[spec.name] = tuple(np.shape(sample[spec.name]))
        else:
            return {}
    return shapes


class FeedsReader:
    """A CalibrationDataReader (ONNX Runtime's duck type: get_next / iteration) over a list of feeds.

    ``progress`` hears ``advance(i, n, "calibration batch i+1 of n")`` as ONNX Runtime takes each batch."""

    def __init__(self, feeds: Iterable[dict[str, np.ndarray]], progress: ProgressReporter = SILENT):
        self._feeds = list(feeds)
        self._pos = 0
        self._progress = progress

    def get_next(self) -> dict[str, np.ndarray] | None:
        n = len(self._feeds)
        if self._pos >= n:
            self._progress.advance(n, n, "computing activation ranges")
            return None
        self._progress.advance(self._pos, n, f"calibration batch {self._pos + 1} of {n}")
        self._pos += 1
        return self._feeds[self._pos - 1]

    def rewind(self) -> None:
        self._pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item

    def __len__(self) -> int:
        return len(self._feeds)
