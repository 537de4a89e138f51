"""Model outputs to answers: CTC logits to text (Wav2Vec2CTCTokenizer's greedy decode), class logits to labels.

CTC:    logits [N, T, V] -> argmax -> collapse repeats -> drop blank (the pad token) -> '|' -> ' ' -> strip
labels: logits [N, C] -> softmax (sigmoid if multi-label) -> top k, best first
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from precast.errors import ArtifactError, InputError

__all__ = ["CTCDecoder", "label_scores"]

MAX_VOCAB = 1 << 20
MAX_TOKEN_CHARS = 64  # bounds a decoded text by frames x 64: a vocab is artifact data, not trusted


def _special(tokenizer_config: Mapping, key: str, default: str | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    value = tokenizer_config.get(key, default)
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ArtifactError(f"tokenizer_config.json: '{key}' is {value!r:.60}; expected a token string")
    return value


@dataclass(frozen=True)
class CTCDecoder:
    """Greedy CTC decoding of a Wav2Vec2CTCTokenizer vocabulary (what transformers' ASR pipeline does for a CTC
    model without a language model)."""

    tokens: tuple[str, ...]  # by id
    blank_id: int  # the pad token: CTC's blank
    word_delimiter: str | None  # the token that stands for a space ('|')
    lower_case: bool = False  # tokenizer_config's do_lower_case

    @classmethod
    def from_vocab(cls, vocab: dict, tokenizer_config: dict | None = None) -> CTCDecoder:
        """vocab.json (token -> id, ids 0..V-1 once each) and tokenizer_config.json (pad_token,
        word_delimiter_token, do_lower_case; transformers' defaults when absent)."""
        if not isinstance(vocab, Mapping) or not 0 < len(vocab) <= MAX_VOCAB:
            raise ArtifactError(f"vocab.json: expected an object of 1..{MAX_VOCAB} token -> id entries")
        tokens: list[str | None] = [None] * len(vocab)
        for token, i in vocab.items():
            if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
                raise ArtifactError(
                    f"vocab.json: token {token!r:.60} is not a string of 1..{MAX_TOKEN_CHARS} chars"
                )
            if (
                isinstance(i, bool)
                or not isinstance(i, int)
                or not 0 <= i < len(vocab)
                or tokens[i] is not None
            ):
                raise ArtifactError(
                    f"vocab.json: token {token!r} has id {i!r:.30}; ids must be 0..{len(vocab) - 1}, each once"
                )
            tokens[i] = token
        config = {} if tokenizer_config is None else tokenizer_config
        if not isinstance(config, Mapping):
            raise ArtifactError("tokenizer_config.json: expected a JSON object")
        pad = _special(config, "pad_token", "<pad>")
        if pad not in vocab:
            raise ArtifactError(
                f"tokenizer_config.json: pad_token {pad!r:.60} (the CTC blank) is not in vocab.json"
            )
        delimiter = _special(config, "word_delimiter_token", "|")
        lower = config.get("do_lower_case", False)
        if not isinstance(lower, bool):
            raise ArtifactError(
                f"tokenizer_config.json: 'do_lower_case' is {lower!r:.60}; expected true or false"
            )
        return cls(tuple(tokens), vocab[pad], delimiter if delimiter in vocab else None, lower)

    def decode(self, logits: np.ndarray, lengths: Sequence[int] | None = None) -> list[str]:
        """[N, T, V] logits -> N texts; ``lengths`` (frames per row) ignores the frames of the padding."""
        logits = np.asarray(logits)
        if logits.ndim != 3 or logits.shape[2] != len(self.tokens):
            raise ArtifactError(
                f"CTC logits have shape {logits.shape}; expected [batch, frames, {len(self.tokens)}] "
                "(one score per vocab.json token)"
            )
        if np.isnan(logits).any():
            raise ArtifactError("CTC logits hold NaN")
        batch, frames = logits.shape[:2]
        if lengths is None:
            lengths = [frames] * batch
        if len(lengths) != batch or any(
            isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= frames
            for n in lengths
        ):
            raise InputError(
                f"lengths: expected {batch} frame counts in 0..{frames}, got {list(lengths)!r:.80}"
            )
        texts = []
        for ids, n in zip(logits.argmax(axis=-1), lengths):
            ids = ids[:n]
            first = np.ones(len(ids), bool)
            first[1:] = ids[1:] != ids[:-1]  # a token held over several frames is one emission
            chars = [self.tokens[t] for t in ids[first] if t != self.blank_id]
            text = "".join(" " if c == self.word_delimiter else c for c in chars).strip()
            texts.append(text.lower() if self.lower_case else text)
        return texts


def _labels(id2label: Mapping, classes: int) -> list[str]:
    """config.json's id2label ({"0": "cat", ...}; int keys too) as a list by class id."""
    if not isinstance(id2label, Mapping):
        raise ArtifactError("id2label: expected an object of class id -> label")
    labels: list[str | None] = [None] * classes
    for key, label in id2label.items():
        i = int(key) if isinstance(key, str) and key.isdecimal() and len(key) < 10 else key
        if (
            isinstance(i, bool)
            or not isinstance(i, int)
            or not 0 <= i < classes
            or not isinstance(label, str)
        ):
            raise ArtifactError(
                f"id2label: entry {key!r:.30} -> {label!r:.30} is not a class id in 0..{classes - 1} with a label"
            )
        labels[i] = label
    missing = [i for i, label in enumerate(labels) if label is None]
    if missing:
        raise ArtifactError(
            f"id2label: no label for class {missing[0]} (the model outputs {classes} classes)"
        )
    return labels


def label_scores(
    logits: np.ndarray, id2label: dict[str, str], top_k: int = 5, multi_label: bool = False
) -> list[list[dict]]:
    """Per row of [N, C] logits, the ``top_k`` best classes: [{"label": ..., "score": float}], best first (ties:
    the lower class id first). Scores are a softmax over the classes, or each class's sigmoid if ``multi_label``."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ArtifactError(f"classification logits have shape {logits.shape}; expected [batch, classes]")
    labels = _labels(id2label, logits.shape[1])
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError(f"top_k: expected a positive integer, got {top_k!r}")
    if np.isnan(logits).any() or (not multi_label and np.isposinf(logits).any()):
        raise ArtifactError("classification logits hold NaN" + ("" if multi_label else " or +inf"))
    if multi_label:
        scores = np.exp(-np.logaddexp(0.0, -logits))  # 1 / (1 + e^-x), without overflow
    else:
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = shifted / shifted.sum(axis=-1, keepdims=True)
    best = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    return [[{"label": labels[j], "score": float(row[j])} for j in order] for row, order in zip(scores, best)]
