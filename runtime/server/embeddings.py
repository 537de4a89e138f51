"""OpenAI-style /v1/embeddings for encoder artifacts: the shipped tokenizer, then the artifact's own
sentence_embedding (a sentence-similarity compile pools and normalises in the graph, as the folder's
sentence-transformers files say), or else mean pooling and L2 normalisation of the last hidden state -- the
recipe of sentence-transformers' all-MiniLM models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, InputError

__all__ = [
    "EncoderSpec",
    "check_dimensions",
    "check_embedding_work",
    "encoder_spec",
    "feeds_for",
    "mean_pool_normalize",
    "parse_inputs",
]

TOKENIZER_FILE = "tokenizer/tokenizer.json"


@dataclass
class EncoderSpec:
    tokenizer_file: str  # the artifact's tokenizer.json (run per request in ``text``)
    output: str  # the rank-3 hidden state output
    has_token_types: bool
    max_length: int
    pad_id: int
    static: bool = False  # the model has a fixed sequence length: pad every request to max_length
    dim: int | None = None  # embedding size, when the hidden state's last axis is static
    pooled: bool = False  # ``output`` is the sentence embedding (sentence-similarity), not token vectors
    embeds: bool = (
        True  # serves /v1/embeddings (a text classifier's spec only tokenizes KServe 'text' inputs)
    )
    text: object | None = None  # text_sandbox.TextSandbox running the tokenizer for requests (start_text)

    def start_text(self, limits=None) -> EncoderSpec:
        """Requests tokenize in a TextSandbox (the tokenizer's regexes are the artifact's code: a process
        per call, with a deadline and a memory limit), not in the server's threads."""
        from precast.runtime.server.text_sandbox import TextLimits, TextSandbox

        what = "the artifact's tokenizer"
        self.text = TextSandbox(
            template=None,
            tokenizer=self.tokenizer_file,
            limits=limits or TextLimits(),
            plain_tokenizer=True,
            what=what,
        ).start()
        return self

    def close(self) -> None:
        if self.text is not None:
            self.text.close()

    async def tokenize(self, texts: list[str], timeout: float) -> tuple[dict[str, np.ndarray], int]:
        """Feeds for one request (right-padded to its longest text) and its token count; the tokenizer runs in
        the sandbox within ``timeout`` s."""
        from starlette.concurrency import run_in_threadpool

        encs = await self.text.acall(
            "encode", {"texts": texts, "type_ids": True}, timeout, sum(map(len, texts))
        )
        return await run_in_threadpool(feeds_for, self, [(ids, types) for ids, types in encs])


_TEXT_HEADS = ("fill-mask", "text-classification", "token-classification")  # one text per row, logits out


def encoder_spec(model, task: str | None = None) -> EncoderSpec | None:
    """An EncoderSpec when the artifact is a text encoder with a shipped tokenizer, else None. ``task``: the
    Hugging Face task of a task artifact; a text classifier's spec tokenizes KServe 'text' inputs (its logits
    are not embeddings), a question-answering model (two texts per row) gets none."""
    if task == "question-answering":
        return None
    names = {s.name for s in model.inputs}
    if not {"input_ids", "attention_mask"} <= names or not names <= {
        "input_ids",
        "attention_mask",
        "token_type_ids",
    }:
        return None
    path = Path(model.path) / TOKENIZER_FILE
    if not path.is_file():
        return None
    # a sentence-similarity artifact pools (and normalises) in its graph, as its sentence-transformers files say
    pooled = [o for o in model.outputs if o.name == "sentence_embedding" and len(o.shape or ()) == 2]
    hidden = (
        pooled
        or [o for o in model.outputs if o.name == ("logits" if task in _TEXT_HEADS else "last_hidden_state")]
        or [o for o in model.outputs if o.shape is not None and len(o.shape) == 3]
    )
    if not hidden:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ArtifactError(
            "serving embeddings needs the 'tokenizers' package: pip install tokenizers"
        ) from e
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # a malformed file is the artifact's fault: exit 3 naming it
        from precast.errors import first_line

        raise ArtifactError(f"cannot read tokenizer {path}: {first_line(e)}") from e
    max_length = 512
    cfg = path.parent / "tokenizer_config.json"
    if cfg.is_file():
        try:
            value = json.loads(cfg.read_text(encoding="utf-8")).get("model_max_length")
            if isinstance(value, int) and 0 < value < 100_000:
                max_length = value
        except (ValueError, UnicodeDecodeError):
            pass
    ids_spec = next(s for s in model.inputs if s.name == "input_ids")
    static = ids_spec.shape is not None and len(ids_spec.shape) == 2 and isinstance(ids_spec.shape[1], int)
    if static:
        max_length = ids_spec.shape[1]
    pad = tok.padding or {}  # (the sandbox's copy pads and truncates nothing: feeds_for does)
    width = hidden[0].shape[-1] if hidden[0].shape else None
    dim = width if isinstance(width, int) else None
    return EncoderSpec(
        str(path),
        hidden[0].name,
        "token_type_ids" in names,
        max_length,
        int(pad.get("pad_id", 0)),
        static,
        dim,
        pooled=bool(pooled),
        embeds=task not in _TEXT_HEADS,
    )


def feeds_for(
    spec: EncoderSpec, encs: list[tuple[list[int], list[int]]]
) -> tuple[dict[str, np.ndarray], int]:
    """Each text's (ids, type ids) -> the model's feeds, right-padded to the longest (cut at max_length)."""
    length = max(min(len(ids), spec.max_length) for ids, _ in encs)
    if spec.static:
        length = spec.max_length
    ids = np.full((len(encs), length), spec.pad_id, dtype=np.int64)
    mask = np.zeros((len(encs), length), dtype=np.int64)
    types = np.zeros((len(encs), length), dtype=np.int64)
    for i, (e_ids, e_types) in enumerate(encs):
        n = min(len(e_ids), spec.max_length)
        ids[i, :n] = e_ids[:n]
        mask[i, :n] = 1
        types[i, :n] = e_types[:n]
    feeds = {"input_ids": ids, "attention_mask": mask}
    if spec.has_token_types:
        feeds["token_type_ids"] = types
    return feeds, int(mask.sum())


def parse_inputs(body: dict, max_inputs: int | None = None, max_chars: int | None = None) -> list[str]:
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InputError("'input' must be a string or a non-empty list of strings")
    if max_inputs is not None and len(value) > max_inputs:  # before looking at each one
        raise InputError(
            f"'input' has {len(value)} texts; this server takes at most {max_inputs} per request "
            "(--max-embedding-inputs)"
        )
    if not all(isinstance(v, str) for v in value):
        raise InputError("'input' must be a string or a non-empty list of strings")
    if any(not v for v in value):
        raise InputError("'input' contains an empty string")
    chars = sum(map(len, value))
    if max_chars is not None and chars > max_chars:  # the tokenizer's time and memory grow with it
        raise InputError(
            f"'input' has {chars} characters; this server tokenizes at most {max_chars} per request "
            "(--max-text-chars; texts past the model's length are cut off anyway)"
        )
    return value


def check_embedding_work(feeds: dict[str, np.ndarray], max_tokens: int) -> None:
    """The model runs every padded position: bound texts x longest text, not the sum of lengths."""
    rows, length = feeds["input_ids"].shape
    if rows * length > max_tokens:
        raise InputError(
            f"'input' needs {rows * length} tokens ({rows} texts x {length}, padded to the longest); "
            f"this server runs at most {max_tokens} per request (--max-embedding-tokens)"
        )


def check_dimensions(body: dict, dim: int | None) -> None:
    """OpenAI's 'dimensions' asks for shortened vectors: only the model's own size is accepted.
    dim None (size not known before a run) checks the type only."""
    value = body.get("dimensions")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"'dimensions' must be a positive integer, got {value!r}")
    if dim is not None and value != dim:
        raise InputError(
            f"'dimensions' must be {dim} (this model's embedding size; shortening is not supported), got {value}"
        )


def mean_pool_normalize(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[:, :, None].astype(np.float32)
    pooled = (hidden.astype(np.float32) * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    return pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
