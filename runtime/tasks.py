"""Hugging Face task artifacts at run time: what users have (an image, a waveform, text) -> feeds -> outputs with
labels, as transformers' pipelines give them -- numpy, PIL and tokenizers only.

    manifest.source (task, modality, id2label, ...) ──> TaskSpec ──> TaskRunner.open(model)
    images / waveforms / texts ──preprocess──> feeds ──Model.run──> outputs ──postprocess──> one result per input

The artifact is untrusted: its source block is read strictly (TaskSpec.from_manifest), its preprocessor config by
runtime/processing, its tokenizer only from tokenizer/tokenizer.json. Inputs run one at a time, as the pipelines
do for these tasks, so padding never changes a result (wav2vec2-base normalises without an attention mask).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, InputError, UsageError, first_line

__all__ = ["TASK_INPUTS", "TaskSpec", "TaskRunner", "softmax"]

# task -> what ``precast run`` / the server take for it
TASK_INPUTS = {
    "feature-extraction": "text",
    "sentence-similarity": "text",
    "fill-mask": "text",
    "text-classification": "text",
    "token-classification": "text",
    "question-answering": "text (the question) and a context",
    "image-classification": "image",
    "image-feature-extraction": "image",
    "zero-shot-image-classification": "image and candidate labels",
    "audio-classification": "audio",
    "automatic-speech-recognition": "audio",
}
_LABELLED = {"text-classification", "token-classification", "image-classification", "audio-classification"}
PROCESSOR = "processor/preprocessor_config.json"
TOKENIZER = "tokenizer/tokenizer.json"
MAX_LABELS = 10_000  # id2label entries read from a manifest
MAX_TEXT_CHARS = 100_000  # one input's characters handed to the tokenizer
ZERO_SHOT_TEMPLATE = "This is a photo of {}."  # transformers' zero-shot-image-classification default


@dataclass(frozen=True)
class TaskSpec:
    task: str
    modality: str
    id2label: dict[int, str] | None = None
    scores: str = "softmax"  # zero-shot: softmax over labels (CLIP) or a sigmoid each (SigLIP)
    text_length: int | None = None  # pad text to this many tokens (SigLIP)

    @classmethod
    def from_manifest(cls, manifest) -> TaskSpec | None:
        """The task block of a Hugging Face task artifact; None for other artifacts (a plain ONNX model, an LLM).
        ArtifactError naming the field when a value is of the wrong type."""
        src = manifest.source if isinstance(manifest.source, dict) else {}
        task = src.get("task")
        if task is None or task == "causal-lm":
            return None
        if task not in TASK_INPUTS:
            raise ArtifactError(f"manifest source.task: unknown task {str(task)[:80]!r}")
        modality = src.get("modality", "text")
        if modality not in ("text", "image", "audio", "image-text"):
            raise ArtifactError(f"manifest source.modality: unknown modality {str(modality)[:80]!r}")
        labels = src.get("id2label")
        if labels is not None:
            if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
                raise ArtifactError(
                    f"manifest source.id2label must be an object of at most {MAX_LABELS} labels"
                )
            try:
                labels = {int(k): str(v)[:200] for k, v in labels.items()}
            except ValueError:
                raise ArtifactError("manifest source.id2label: keys must be integers") from None
        scores = src.get("scores", "softmax")
        if scores not in ("softmax", "sigmoid"):
            raise ArtifactError(
                f"manifest source.scores must be softmax or sigmoid, not {str(scores)[:40]!r}"
            )
        length = src.get("text_length")
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= 8192
        ):
            raise ArtifactError("manifest source.text_length must be an integer in 1..8192")
        return cls(task, modality, labels, scores, length)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class TaskRunner:
    """A loaded task artifact with its pre- and postprocessing: ``run(images=..., audio=..., texts=...)`` -> a list
    of results, one per input (labels and scores, decoded text, an answer span, an embedding)."""

    def __init__(self, model, spec: TaskSpec, processing=None, tokenizer=None, ctc=None, pad_id: int = 0):
        self.model, self.spec = model, spec
        self.processing, self.tokenizer, self.ctc, self.pad_id = processing, tokenizer, ctc, pad_id
        self.inputs = {s.name for s in model.inputs}

    @classmethod
    def open(cls, model, text: bool = True) -> TaskRunner | None:
        """None when the artifact is not a Hugging Face task; ArtifactError for a bad shipped file. ``text``:
        load the artifact's tokenizer into this process (the server runs tokenizers in its sandbox instead)."""
        spec = TaskSpec.from_manifest(model.manifest)
        if spec is None:
            return None
        root = Path(model.path)
        processing = tokenizer = ctc = None
        pad_id = 0
        if (root / PROCESSOR).is_file():
            from precast.runtime.processing import processing_from_config

            processing = processing_from_config(_read_json(root / PROCESSOR))
        if text and (root / TOKENIZER).is_file() and spec.modality in ("text", "image-text"):
            tokenizer, pad_id = _tokenizer(root / TOKENIZER)
        if spec.task == "automatic-speech-recognition" and (root / "tokenizer/vocab.json").is_file():
            from precast.runtime.processing import CTCDecoder

            config = root / "tokenizer/tokenizer_config.json"
            ctc = CTCDecoder.from_vocab(
                _read_json(root / "tokenizer/vocab.json"), _read_json(config) if config.is_file() else None
            )
        return cls(model, spec, processing, tokenizer, ctc, pad_id)

    # -- inputs -------------------------------------------------------------------------------------------
    def _needs(self, what: str, have) -> None:
        if have is None:
            raise InputError(
                f"this {self.spec.task} artifact ships no {what}; pass the model's feeds (-i FILE) instead"
            )

    def check_inputs(self, images=(), audio=(), texts=(), labels=(), context=None) -> None:
        """A one-line InputError when the inputs do not fit the task (an image for a speech model, ...)."""
        want = TASK_INPUTS[self.spec.task]
        kinds = {"image": bool(images), "audio": bool(audio), "text": bool(texts)}
        need = {"text": "text" in want, "image": "image" in want, "audio": "audio" in want}
        wrong = [k for k, v in kinds.items() if v and not need[k]]
        if wrong or not any(kinds.values()):
            given = ", ".join(k for k, v in kinds.items() if v) or "nothing"
            raise InputError(f"task {self.spec.task} takes {want}; got {given}")
        if self.spec.task == "zero-shot-image-classification" and len(labels) < 1:
            raise InputError("zero-shot-image-classification needs candidate labels (--labels 'cat,dog')")
        if self.spec.task == "question-answering" and not context:
            raise InputError("question-answering needs a context (--context TEXT) to find the answer in")

    def image_feeds(self, image: np.ndarray) -> dict[str, np.ndarray]:
        self._needs("preprocessor_config.json", self.processing)
        return {"pixel_values": self.processing([image])}

    def audio_feeds(self, wave: np.ndarray, rate: int) -> dict[str, np.ndarray]:
        self._needs("preprocessor_config.json", self.processing)
        feeds = self.processing([wave], rate)
        return {k: v for k, v in feeds.items() if k in self.inputs}

    def text_feeds(self, texts: Sequence[str], pair: str | None = None):
        """Feeds for ``texts`` (one row each; with ``pair``, (text, pair) as the model's two segments) and the
        tokenizer's encodings (offsets, special-token marks)."""
        self._needs("tokenizer (tokenizer/tokenizer.json)", self.tokenizer)
        for t in [*texts, pair or ""]:
            if len(t) > MAX_TEXT_CHARS:
                raise InputError(f"a text has {len(t)} characters; at most {MAX_TEXT_CHARS} are tokenized")
        try:
            encs = [
                self.tokenizer.encode(t, pair) if pair is not None else self.tokenizer.encode(t)
                for t in texts
            ]
        except Exception as e:  # the tokenizers library raises plain Exception
            raise InputError(f"the artifact's tokenizer failed on this input: {first_line(e)}") from e
        limit = self._max_tokens()
        length = self.spec.text_length or min(max(len(e.ids) for e in encs), limit)
        ids = np.full((len(encs), length), self.pad_id, np.int64)
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        for i, e in enumerate(encs):
            n = min(len(e.ids), length)
            ids[i, :n], mask[i, :n], types[i, :n] = e.ids[:n], 1, e.type_ids[:n]
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {k: v for k, v in arrays.items() if k in self.inputs}, encs

    def _max_tokens(self) -> int:
        ids = next((s for s in self.model.inputs if s.name == "input_ids"), None)
        if ids is not None and ids.shape and isinstance(ids.shape[-1], int):
            return ids.shape[-1]
        trunc = self.tokenizer.truncation or {}
        return int(trunc.get("max_length", 512))

    # -- one call -------------------------------------------------------------------------------------------
    def run(self, images=(), audio=(), texts=(), labels=(), context=None, top_k: int = 5) -> list:
        """One result per image / waveform ((array, rate)) / text, in order."""
        self.check_inputs(images, audio, texts, labels, context)
        if top_k < 1:
            raise InputError(f"top_k must be at least 1, got {top_k}")
        task = self.spec.task
        results = []
        for image in images:
            if task == "zero-shot-image-classification":
                results.append(self._zero_shot(image, labels))
            else:
                results.append(self._finish(self.model.run(self.image_feeds(image)), None, top_k))
        for wave, rate in audio:
            feeds = self.audio_feeds(wave, rate)
            results.append(self._finish(self.model.run(feeds), None, top_k))
        for text in texts:
            qa = task == "question-answering"
            feeds, encs = self.text_feeds([text], context if qa else None)
            out = self.model.run(feeds)
            if qa:
                results.append(self._answer(out["start_logits"][0], out["end_logits"][0], encs[0], context))
            else:
                results.append(self._finish(out, encs[0], top_k))
        return results

    def _finish(self, out: dict[str, np.ndarray], enc, top_k: int):
        from precast.runtime.processing import label_scores

        task = self.spec.task
        if task in _LABELLED and task != "token-classification":
            return label_scores(out["logits"], self.labels(out["logits"].shape[-1]), top_k)[0]
        if task == "automatic-speech-recognition":
            self._needs("CTC vocabulary (tokenizer/vocab.json)", self.ctc)
            return {"text": self.ctc.decode(out["logits"])[0]}
        if task == "token-classification":
            return self._tokens(out["logits"][0], enc)
        if task == "fill-mask":
            return self._fill(out["logits"][0], enc, top_k)
        return {"embedding": _embedding(out).tolist()}

    def labels(self, n: int) -> dict[str, str]:
        """Class index (as a string) -> label, for ``n`` classes (LABEL_i where id2label has none)."""
        labels = self.spec.id2label or {}
        return {str(i): labels.get(i, f"LABEL_{i}") for i in range(n)}

    def _tokens(self, logits: np.ndarray, enc) -> list[dict]:
        """Each word piece that is not a special token: its label, score and character span (as the
        token-classification pipeline with aggregation_strategy='none')."""
        probs = softmax(logits)
        names = self.labels(logits.shape[-1])
        out = []
        for i, (tok, special, (start, end)) in enumerate(
            zip(enc.tokens, enc.special_tokens_mask, enc.offsets)
        ):
            if special or i >= len(probs):
                continue
            k = int(probs[i].argmax())
            out.append(
                {
                    "entity": names[str(k)],
                    "score": float(probs[i, k]),
                    "word": tok,
                    "start": start,
                    "end": end,
                }
            )
        return out

    def _answer(
        self, start: np.ndarray, end: np.ndarray, enc, context_text: str, max_answer: int = 30
    ) -> dict:
        """The best span of the context (sequence 1) by start + end logits, end >= start, at most ``max_answer``
        tokens, as the question-answering pipeline scores it (softmax over the context's positions)."""
        context = np.array([s == 1 for s in enc.sequence_ids[: len(start)]])
        if not context.any():
            raise InputError("the context was cut off entirely: shorten the question")
        ps = softmax(np.where(context, start, -np.inf))
        pe = softmax(np.where(context, end, -np.inf))
        scores = np.triu(np.outer(ps, pe)) - np.triu(np.outer(ps, pe), max_answer)
        i, j = np.unravel_index(int(scores.argmax()), scores.shape)
        lo, hi = enc.offsets[i][0], enc.offsets[j][1]
        return {"score": float(scores[i, j]), "start": int(lo), "end": int(hi), "answer": context_text[lo:hi]}

    def _fill(self, logits: np.ndarray, enc, top_k: int) -> list[dict]:
        mask_id = self.tokenizer.token_to_id("[MASK]")
        if mask_id is None:
            mask_id = self.tokenizer.token_to_id("<mask>")
        spots = [i for i, t in enumerate(enc.ids) if t == mask_id and i < len(logits)]
        if not spots:
            raise InputError("fill-mask needs a mask token ([MASK] or <mask>) in the text")
        out = []
        for i in spots:
            p = softmax(logits[i])
            best = np.argsort(-p)[:top_k]
            out.append(
                [
                    {"token": int(t), "token_str": self.tokenizer.id_to_token(int(t)), "score": float(p[t])}
                    for t in best
                ]
            )
        return out

    def _zero_shot(self, image: np.ndarray, labels: Sequence[str]) -> list[dict]:
        if len(labels) > 1000:
            raise InputError(f"{len(labels)} candidate labels; at most 1000")
        feeds, _ = self.text_feeds([ZERO_SHOT_TEMPLATE.format(label) for label in labels])
        out = self.model.run({**feeds, **self.image_feeds(image)})
        logits = out["logits_per_image"][0]
        probs = (
            1 / (1 + np.exp(-logits.astype(np.float64))) if self.spec.scores == "sigmoid" else softmax(logits)
        )
        order = np.argsort(-probs, kind="stable")
        return [{"label": labels[i], "score": float(probs[i])} for i in order]


def _embedding(out: dict[str, np.ndarray]) -> np.ndarray:
    """One vector: the sentence embedding, the pooled output, or the first token's hidden state."""
    for name in ("sentence_embedding", "pooler_output", "image_embeds", "text_embeds"):
        if name in out:
            return out[name][0]
    hidden = next(iter(out.values()))
    return hidden[0, 0] if hidden.ndim == 3 else hidden[0]


def _read_json(path: Path):
    try:
        if path.stat().st_size > 16 << 20:
            raise ArtifactError(f"{path.name} is over 16 MiB")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact file {path.name}: not valid JSON ({first_line(e)})") from e


def _tokenizer(path: Path) -> tuple:
    """(the artifact's tokenizer with its padding off, its pad id)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("text inputs need the 'tokenizers' package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
        raise ArtifactError(f"cannot read tokenizer {path.name}: {first_line(e)}") from e
    pad = tok.padding or {}
    tok.no_padding()  # a file's fixed-length padding would be fed as real tokens: text_feeds pads and masks
    return tok, int(pad.get("pad_id", 0))
