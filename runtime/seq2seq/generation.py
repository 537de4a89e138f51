"""Decoding logic of an encoder-decoder generation engine, token-for-token equal to Hugging Face transformers'
``generate()`` (5.25): the generation settings of a ``generation_config.json``, the logits processors in HF's
order, greedy / sampled next tokens, and one request's beam search.

Pure numpy: the caller runs the model (encoder once, decoder per step) and hands this module the last position's
logits; this module picks tokens, and for beam search says which running beam each new beam continues
(``BeamSearch.step`` returns the parents, so the caller forks its KV caches).

HF's processor order (``GenerationMixin._get_logits_processor``) for what is implemented here:
no-repeat-ngram, bad words, min length, min new tokens, forced BOS (at decoder length 1), forced EOS (at
max_length - 1), suppress tokens, suppress tokens at begin (at the decoder prompt's length; Whisper), then, when
sampling, temperature, top-k, top-p, and last the renormalization (log-softmax) when ``renormalize_logits``.
Greedy runs them on the raw logits; beam search on the float32 log-softmax of the logits, then adds each beam's
running score. All arithmetic that decides a token is float32, as torch does it (a float32 tensor divided by a
Python float divides by the float32 rounding of that float).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from precast.errors import ArtifactError, InputError, UsageError

__all__ = [
    "GenerationSettings",
    "BeamSearch",
    "process_logits",
    "greedy_next",
    "sample_next",
    "is_finished",
]

DEFAULT_MAX_NEW_TOKENS = (
    20  # HF: max_length defaults to 20 + the decoder prompt's length when nothing sets it
)
_NEG = np.float32(-1.0e9)  # HF's "very large negative" beam score (exact in float32)

# Keys HF writes into generation_config.json that do not change which tokens come out (bookkeeping, output
# switches, caching / compilation / assisted-decoding knobs, Whisper's prompt building and timestamp machinery).
IGNORED_KEYS = frozenset(
    {
        "_from_model_config",
        "_commit_hash",
        "transformers_version",
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "continuous_batching_config",
        "prefill_chunk_size",
        "return_legacy_cache",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
        "assistant_early_exit",
        "assistant_ensemble_weight",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
        "speculation_type",
        # Whisper: the decoder prompt (language / task tokens) and timestamps are the engine's business
        "alignment_heads",
        "lang_to_id",
        "task_to_id",
        "is_multilingual",
        "no_timestamps_token_id",
        "max_initial_timestamp_index",
        "prev_sot_token_id",
        "return_timestamps",
        "language",
        "task",
    }
)

# Keys that would change tokens and that this module does not implement: accepted only at their no-op value.
NOOP_VALUES: dict[str, tuple] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "min_p": (None,),
    "top_h": (None,),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "sequence_bias": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
    "max_time": (None,),
    "stop_strings": (None,),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "watermarking_config": (None,),
    "low_memory": (None, False),
    "token_healing": (None, False),
    "use_mtp": (None, False),
    "no_speech_threshold": (None,),
    "logprob_threshold": (None,),
    "compression_ratio_threshold": (None,),
    "condition_on_prev_tokens": (None, False),
}


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class GenerationSettings:
    """What decides the tokens of one generation, as HF's GenerationConfig (5.25 defaults where unset).

    ``eos_token_id`` / ``forced_eos_token_id`` are tuples (a JSON int becomes a 1-tuple; ``()`` = none).
    ``max_length`` counts the decoder prompt (HF); ``None`` = 20 new tokens unless ``max_new_tokens`` says.
    ``forced_decoder_ids`` (Whisper's legacy ``[[position, id], ...]``) is recorded for whoever builds the decoder
    prompt; the processors never apply it."""

    decoder_start_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    renormalize_logits: bool = False
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    num_return_sequences: int = 1
    forced_decoder_ids: tuple[tuple[int, int | None], ...] | None = None

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, d: dict, where: str) -> GenerationSettings:
        """Read a ``generation_config.json`` dict strictly: ArtifactError (naming ``where`` and the key) on an
        unknown key, a bad value, or a token-changing option this module does not implement."""
        if not isinstance(d, dict):
            raise ArtifactError(
                f"{where}: generation_config.json must be a JSON object, got {type(d).__name__}"
            )
        names = {f.name for f in fields(cls)}
        values = {}
        for key, value in d.items():
            if key in names:
                values[key] = value
            elif key in IGNORED_KEYS:
                continue
            elif key in NOOP_VALUES:
                if not _is_noop(key, value):
                    raise ArtifactError(
                        f"{where}: generation_config.json sets {key}={value!r}, which precast's seq2seq decoding "
                        "does not implement"
                    )
            else:
                raise ArtifactError(f"{where}: generation_config.json has an unknown key {key!r}")
        return _build(cls(), values, ArtifactError, f"{where}: generation_config.json")

    def with_overrides(self, **kw) -> GenerationSettings:
        """Per-request values on top of these (UsageError on an unknown name or a bad value). ``None`` resets an
        optional field (e.g. ``max_length=None``)."""
        names = {f.name for f in fields(self)}
        for key in kw:
            if key not in names:
                raise UsageError(f"unknown generation option {key!r} (known: {', '.join(sorted(names))})")
        return _build(self, kw, UsageError, "generation option")

    # ---- derived ------------------------------------------------------------------------------------------

    def resolve_max_length(self, prompt_len: int, max_position_embeddings: int | None = None) -> int:
        """The absolute decoder length generation stops at, as HF's ``_prepare_generated_length``:
        max_new_tokens + prompt_len, else max_length, else 20 + prompt_len capped at the model's positions."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens + prompt_len
        if self.max_length is not None:
            return self.max_length
        n = DEFAULT_MAX_NEW_TOKENS + prompt_len
        return min(n, max_position_embeddings) if max_position_embeddings is not None else n

    def resolve_min_length(self, prompt_len: int) -> int:
        """The absolute decoder length below which EOS is banned (min_new_tokens + prompt_len wins)."""
        if self.min_new_tokens is not None:
            return self.min_new_tokens + prompt_len
        return self.min_length

    @property
    def effective_pad_token_id(self) -> int | None:
        """HF's pad: the pad id, else the first EOS (what finished greedy rows are filled with)."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id[0] if self.eos_token_id else None

    @property
    def beam_fill_token_id(self) -> int:
        """What HF's beam search pads short finished hypotheses with: ``pad or eos[0]`` (so a pad id of 0, as
        T5's, gives the EOS), -1 without an EOS."""
        if not self.eos_token_id:
            return -1
        pad = self.effective_pad_token_id
        return pad if pad else self.eos_token_id[0]


def _is_noop(key: str, value) -> bool:
    for ok in NOOP_VALUES[key]:
        if ok is None:
            if value is None:
                return True
        elif _is_bool(ok):
            if _is_bool(value) and bool(value) == ok:
                return True
        elif _is_real(value) and float(value) == float(ok):
            return True
    return False


def _build(base: GenerationSettings, values: dict, err, where: str) -> GenerationSettings:
    """Validate and normalize ``values`` over ``base``; ``err`` (ArtifactError / UsageError) names the key."""
    out = {}

    def bad(key, value, what):
        raise err(f"{where}: {key} must be {what}, got {value!r}")

    def token(key, value, optional=True):
        if value is None and optional:
            return None
        if not _is_int(value) or value < 0:
            bad(key, value, "a token id (an integer >= 0)" + (" or null" if optional else ""))
        return int(value)

    def token_tuple(key, value, allow_int: bool):
        if allow_int and _is_int(value):
            value = [value]
        if not isinstance(value, (list, tuple)) or any(not _is_int(t) or t < 0 for t in value):
            bad(key, value, "a list of token ids" + (" or one token id" if allow_int else ""))
        return tuple(int(t) for t in value)

    def count(key, value, minimum, optional):
        if value is None and optional:
            return None
        if not _is_int(value) or value < minimum:
            bad(key, value, f"an integer >= {minimum}" + (" or null" if optional else ""))
        return int(value)

    for key, value in values.items():
        if key in ("decoder_start_token_id", "bos_token_id", "pad_token_id", "forced_bos_token_id"):
            out[key] = token(key, value)
        elif key == "eos_token_id":
            out[key] = () if value is None else token_tuple(key, value, allow_int=True)
        elif key == "forced_eos_token_id":
            out[key] = None if value is None else token_tuple(key, value, allow_int=True)
            if out[key] == ():
                bad(key, value, "a token id or a non-empty list of them")
        elif key in ("suppress_tokens", "begin_suppress_tokens"):
            out[key] = None if value is None else token_tuple(key, value, allow_int=False)
        elif key == "bad_words_ids":
            if value is None:
                out[key] = None
                continue
            if (
                not isinstance(value, (list, tuple))
                or not value
                or any(not isinstance(w, (list, tuple)) or not w for w in value)
            ):
                bad(key, value, "a non-empty list of non-empty token id lists")
            out[key] = tuple(token_tuple(key, w, allow_int=False) for w in value)
        elif key in ("max_length", "max_new_tokens"):
            out[key] = count(key, value, 1, optional=True)
        elif key == "min_length":
            out[key] = 0 if value is None else count(key, value, 0, optional=False)
        elif key == "min_new_tokens":
            out[key] = count(key, value, 0, optional=True)
        elif key in ("num_beams", "num_return_sequences"):
            out[key] = 1 if value is None else count(key, value, 1, optional=False)
        elif key == "no_repeat_ngram_size":
            out[key] = 0 if value is None else count(key, value, 0, optional=False)
        elif key == "top_k":
            out[key] = 50 if value is None else count(key, value, 0, optional=False)
        elif key == "length_penalty":
            value = 1.0 if value is None else value
            if not _is_real(value) or not np.isfinite(value):
                bad(key, value, "a finite number")
            out[key] = float(value)
        elif key == "temperature":
            value = 1.0 if value is None else value
            if not _is_real(value) or not (0.0 < value < float("inf")):
                bad(key, value, "a number > 0")
            out[key] = float(value)
        elif key == "top_p":
            value = 1.0 if value is None else value
            if not _is_real(value) or not (0.0 < value <= 1.0):
                bad(key, value, "a number in (0, 1]")
            out[key] = float(value)
        elif key == "early_stopping":
            value = False if value is None else value
            if not (_is_bool(value) or value == "never"):
                bad(key, value, 'true, false or "never"')
            out[key] = value if value == "never" else bool(value)
        elif key in ("do_sample", "renormalize_logits"):
            value = False if value is None else value
            if not _is_bool(value):
                bad(key, value, "true or false")
            out[key] = bool(value)
        elif key == "forced_decoder_ids":
            if value is None:
                out[key] = None
                continue
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(p, (list, tuple))
                and len(p) == 2
                and _is_int(p[0])
                and p[0] >= 0
                and (p[1] is None or (_is_int(p[1]) and p[1] >= 0))
                for p in value
            )
            if not ok:
                bad(key, value, "a list of [position, token id or null] pairs")
            out[key] = tuple((int(p), None if t is None else int(t)) for p, t in value)
        else:  # pragma: no cover - every field is handled above
            raise err(f"{where}: unknown key {key!r}")
    return replace(base, **out)


# ---- logits processing ------------------------------------------------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float32 log-softmax as torch computes it: (x - max) - log(sum(exp(x - max))), the log-sum rounded from
    float64 (torch's own float32 sum can differ from it in the last bit: a per-row constant)."""
    x = np.asarray(x, dtype=np.float32)
    m = x.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = x - m
        lse = np.log(np.exp(s.astype(np.float64)).sum(axis=-1, keepdims=True)).astype(np.float32)
        return s - lse


def _as_rows(sequences, n: int, what: str) -> list[Sequence[int]]:
    if isinstance(sequences, np.ndarray):
        if sequences.ndim != 2:
            raise InputError(
                f"{what}: sequences must be 2-D (rows of token ids), got shape {sequences.shape}"
            )
        rows = [r for r in sequences]
    else:
        rows = list(sequences)
    if len(rows) != n:
        raise InputError(f"{what}: {len(rows)} sequences for {n} rows of logits")
    for r in rows:
        if len(r) == 0:
            raise InputError(f"{what}: a decoder sequence is empty (it starts with the decoder start token)")
    return rows


def _check_logits(logits, what: str) -> np.ndarray:
    a = np.asarray(logits)
    if a.ndim != 2 or a.shape[1] == 0:
        raise InputError(f"{what}: logits must be [rows, vocab], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise InputError(f"{what}: logits must be floating point, got {a.dtype}")
    return np.array(a, dtype=np.float32, copy=True)


def _banned_ngram_tokens(seq: np.ndarray, n: int) -> np.ndarray:
    """HF's NoRepeatNGram: the tokens that would complete an n-gram already in ``seq`` (the whole decoder
    sequence, prompt included)."""
    cur = seq.shape[0]
    if cur < n:
        return seq[:0]
    if n == 1:
        return seq
    windows = np.lib.stride_tricks.sliding_window_view(seq, n)  # [cur - n + 1, n]
    prefix = seq[cur + 1 - n :]
    match = (windows[:, :-1] == prefix).all(axis=1)
    return windows[match, -1]


def process_logits(
    settings: GenerationSettings,
    scores: np.ndarray,
    sequences,
    prompt_len: int | Sequence[int],
    max_length: int | Sequence[int],
    *,
    warp: bool = False,
) -> np.ndarray:
    """HF's logits processors on ``scores`` [N, V] (float32; raw logits for greedy / sampling, log-softmax for
    beam search) for rows whose decoder sequences (prompt included) are ``sequences`` (N lists; they may differ
    in length). ``prompt_len`` / ``max_length``: one value or one per row (absolute decoder lengths). ``warp``:
    also the sampling warpers (temperature, top-k, top-p). Returns a new float32 array."""
    scores = _check_logits(scores, "process_logits")
    n, vocab = scores.shape
    rows = _as_rows(sequences, n, "process_logits")
    plens = [int(prompt_len)] * n if _is_int(prompt_len) else [int(p) for p in prompt_len]
    maxes = [int(max_length)] * n if _is_int(max_length) else [int(m) for m in max_length]
    if len(plens) != n or len(maxes) != n:
        raise InputError(f"process_logits: prompt_len / max_length must be one int or {n} of them")
    s = settings
    eos = np.asarray(s.eos_token_id, dtype=np.int64)
    eos_in = eos[eos < vocab]
    ninf = np.float32(-np.inf)
    bad_single, bad_multi = _bad_words(s, vocab)
    suppress = _in_vocab(s.suppress_tokens, vocab)
    begin_suppress = _in_vocab(s.begin_suppress_tokens, vocab)
    forced = ((s.forced_bos_token_id,) if s.forced_bos_token_id is not None else ()) + (
        s.forced_eos_token_id or ()
    )
    if any(t >= vocab for t in forced):
        raise InputError(f"forced BOS / EOS token {max(forced)} is outside the model's vocabulary of {vocab}")
    forced_eos = list(s.forced_eos_token_id or ())
    for i in range(n):
        seq = np.asarray(rows[i], dtype=np.int64)
        cur = seq.shape[0]
        row = scores[i]
        if s.no_repeat_ngram_size > 0:
            banned = _banned_ngram_tokens(seq, s.no_repeat_ngram_size)
            row[banned[banned < vocab]] = ninf
        if bad_single is not None:
            row[bad_single] = ninf
            for prefix, last in bad_multi:
                k = len(prefix)
                if k <= cur and tuple(seq[cur - k :].tolist()) == prefix:
                    row[last] = ninf
        if eos.size and cur < s.resolve_min_length(plens[i]):  # MinLength and MinNewTokens
            row[eos_in] = ninf
        if s.forced_bos_token_id is not None and cur == 1:
            row[:] = ninf
            row[s.forced_bos_token_id] = 0.0
        if s.forced_eos_token_id is not None and cur == maxes[i] - 1:
            row[:] = ninf
            row[forced_eos] = 0.0
        if suppress is not None:
            row[suppress] = ninf
        if begin_suppress is not None:
            begin = plens[i] if (plens[i] > 1 or s.forced_bos_token_id is None) else plens[i] + 1
            if cur == begin:
                row[begin_suppress] = ninf
    if warp:
        scores = _warp(s, scores)
    if s.renormalize_logits:
        scores = _log_softmax(scores)
    return scores


def _in_vocab(ids, vocab: int):
    if ids is None:
        return None
    a = np.asarray(ids, dtype=np.int64)
    return a[a < vocab]


def _bad_words(s: GenerationSettings, vocab: int):
    """HF's NoBadWords: single-token words banned always, longer ones when the sequence ends with their prefix;
    a word that is exactly one EOS is dropped. An id outside the vocabulary is refused (as HF does)."""
    if s.bad_words_ids is None:
        return None, ()
    words = [w for w in s.bad_words_ids if not (len(w) == 1 and w[0] in s.eos_token_id)]
    for w in words:
        for t in w:
            if t >= vocab:
                raise InputError(f"bad_words_ids: token {t} is outside the model's vocabulary of {vocab}")
    single = np.asarray([w[0] for w in words if len(w) == 1], dtype=np.int64)
    multi = tuple((tuple(w[:-1]), w[-1]) for w in words if len(w) > 1)
    return single, multi


def _warp(s: GenerationSettings, scores: np.ndarray) -> np.ndarray:
    """HF's sampling warpers (min_tokens_to_keep 1): temperature, top-k, top-p."""
    if s.temperature != 1.0:
        scores = scores / np.float32(s.temperature)
    vocab = scores.shape[-1]
    if s.top_k:
        k = min(s.top_k, vocab)
        kth = -np.sort(-scores, axis=-1)[:, k - 1 : k]
        scores = np.where(scores < kth, np.float32(-np.inf), scores)
    if s.top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as HF's sort
        srt = np.take_along_axis(scores, order, axis=-1)
        p = np.exp(_log_softmax(srt).astype(np.float64))
        remove = np.cumsum(p, axis=-1) <= (1.0 - s.top_p)
        remove[:, -1] = False
        mask = np.zeros_like(remove)
        np.put_along_axis(mask, order, remove, axis=-1)
        scores = np.where(mask, np.float32(-np.inf), scores)
    return scores


# ---- greedy / sampling ------------------------------------------------------------------------------------


def _lengths(settings, prompt_len, max_length):
    if max_length is None:
        if _is_int(prompt_len):
            return settings.resolve_max_length(int(prompt_len))
        return [settings.resolve_max_length(int(p)) for p in prompt_len]
    return max_length


def greedy_next(
    settings: GenerationSettings,
    logits: np.ndarray,
    sequences,
    prompt_len: int | Sequence[int],
    *,
    max_length: int | Sequence[int] | None = None,
) -> np.ndarray:
    """The next token of each row (int64 [N]), as HF's greedy search: the processors on the raw float32 logits
    [N, V], then the first argmax. ``sequences``: each row's decoder tokens so far, prompt included;
    ``prompt_len``: the decoder prompt's length (one or per row); ``max_length``: the absolute stop length
    (default ``settings.resolve_max_length(prompt_len)``; it places the forced EOS). The caller stops a row once
    ``is_finished`` (HF then pads it with ``effective_pad_token_id``)."""
    scores = process_logits(
        settings, logits, sequences, prompt_len, _lengths(settings, prompt_len, max_length)
    )
    return scores.argmax(axis=-1).astype(np.int64)


def sample_next(
    settings: GenerationSettings,
    logits: np.ndarray,
    sequences,
    prompt_len: int | Sequence[int],
    rngs: np.random.Generator | Sequence[np.random.Generator],
    *,
    max_length: int | Sequence[int] | None = None,
) -> np.ndarray:
    """HF's multinomial sampling semantics (processors, then temperature / top-k / top-p), drawn from numpy
    Generators (one per row, or one for all): reproducible from the seed, not HF's torch random stream."""
    scores = process_logits(
        settings, logits, sequences, prompt_len, _lengths(settings, prompt_len, max_length), warp=True
    )
    n = scores.shape[0]
    gens = [rngs] * n if isinstance(rngs, np.random.Generator) else list(rngs)
    if len(gens) != n:
        raise InputError(f"sample_next: {len(gens)} random generators for {n} rows")
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        x = scores[i].astype(np.float64)
        if not np.isfinite(x.max()):
            raise InputError(f"sample_next: row {i} has no finite score to sample from")
        p = np.exp(x - x.max())
        c = np.cumsum(p)
        idx = int(np.searchsorted(c, gens[i].random() * c[-1], side="right"))
        out[i] = idx if idx < p.shape[0] else int(np.flatnonzero(p)[-1])
    return out


def is_finished(settings: GenerationSettings, sequence: Sequence[int], max_length: int) -> bool:
    """HF's stopping criteria for one row: its last token is an EOS, or it reached ``max_length``."""
    return len(sequence) >= max_length or (len(sequence) > 0 and int(sequence[-1]) in settings.eos_token_id)


# ---- beam search ------------------------------------------------------------------------------------------


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of a 1-D float32 array, descending; ties by lower index first (torch.topk leaves
    tie order unspecified; it only shows with exactly equal scores). O(n) selection, then a sort of the k."""
    n = x.shape[0]
    if k >= n:
        return np.argsort(-x, kind="stable")[:k]
    kth = x[np.argpartition(-x, k - 1)[:k]].min()
    above = np.flatnonzero(x > kth)
    idx = np.concatenate([above, np.flatnonzero(x == kth)[: k - above.size]])
    return idx[np.lexsort((idx, -x[idx]))]


class BeamSearch:
    """HF 5.25's beam search (``GenerationMixin._beam_search``, not sampling) for ONE request.

    ``beams``: the ``num_beams`` running decoder sequences (at first the prompt once per beam, with running scores
    [0, -1e9, ...] so only the first beam's continuations count). Each ``step(logits)`` takes the model's
    last-position logits for every running beam (row i = ``beams[i]``), keeps the top ``2 * num_beams`` (more with
    several EOS ids) continuations over all beams, moves the top-``num_beams`` ones that end (EOS or max_length)
    into the finished set (score = sum of log-probs / generated_length ** length_penalty), and returns the
    parent of each new running beam: new beam i = old beam ``parents[i]`` + one token (fork the KV caches so).
    ``done`` follows HF's loop condition (early_stopping True: all finished slots full; False / "never": the best
    running beam can no longer beat the worst finished one; or every candidate hit max_length).
    ``results()``: the finished hypotheses best-first (``num_return_sequences``), each its tokens (prompt
    included, up to and including its EOS) and HF's ``sequences_scores``; ``padded_results()`` is HF's
    ``sequences`` array exactly (short ones filled with ``beam_fill_token_id``)."""

    def __init__(self, settings: GenerationSettings, prompt: Sequence[int], max_length: int):
        s = settings
        if s.do_sample:
            raise UsageError(
                "beam search with do_sample=True (beam sampling) is not supported; set do_sample=False"
            )
        if s.num_return_sequences > s.num_beams:
            raise UsageError(
                f"num_return_sequences ({s.num_return_sequences}) must be <= num_beams ({s.num_beams})"
            )
        prompt = [int(t) for t in prompt]
        if not prompt or any(t < 0 for t in prompt):
            raise InputError(f"beam search prompt must be a non-empty list of token ids, got {prompt!r}")
        if not _is_int(max_length) or max_length <= len(prompt):
            raise UsageError(
                f"max_length ({max_length!r}) must be larger than the decoder prompt's length ({len(prompt)})"
            )
        self.settings = s
        self.max_length = int(max_length)
        self.prompt_len = len(prompt)
        nb = s.num_beams
        self.num_beams = nb
        self._eos = np.asarray(s.eos_token_id, dtype=np.int64)
        self._k = max(2, 1 + len(s.eos_token_id)) * nb
        self._top_mask = np.arange(self._k) < nb
        fill = s.beam_fill_token_id
        self._running = np.full((nb, self.max_length), fill, dtype=np.int64)
        self._running[:, : self.prompt_len] = prompt
        self._run_scores = np.zeros(nb, dtype=np.float32)
        self._run_scores[1:] = _NEG
        self._fin_seqs = self._running.copy()
        self._fin_scores = np.full(nb, _NEG, dtype=np.float32)
        self._fin_done = np.zeros(nb, dtype=bool)
        self._fin_len = np.full(nb, self.prompt_len, dtype=np.int64)
        self._unsat = True  # HF's is_early_stop_heuristic_unsatisfied
        self.cur_len = self.prompt_len
        self.done = False
        self.steps = 0

    @property
    def beams(self) -> list[list[int]]:
        return [r[: self.cur_len].tolist() for r in self._running]

    @property
    def beam_scores(self) -> np.ndarray:
        """The running beams' summed log-probs (float32 [num_beams])."""
        return self._run_scores.copy()

    def step(self, logits: np.ndarray) -> list[int]:
        if self.done:
            raise UsageError("beam search is done; read results()")
        s = self.settings
        nb, k, cur, plen = self.num_beams, self._k, self.cur_len, self.prompt_len
        x = _check_logits(logits, "BeamSearch.step")
        if x.shape[0] != nb:
            raise InputError(f"BeamSearch.step: logits have {x.shape[0]} rows for {nb} beams")
        vocab = x.shape[1]
        if vocab * nb < k:
            raise InputError(f"BeamSearch.step: a vocabulary of {vocab} is too small for {nb} beams")
        running = self._running[:, :cur]
        # b. log-probs, processors, plus the running scores (all float32)
        lp = process_logits(s, _log_softmax(x), running, plen, self.max_length)
        acc = (lp + self._run_scores[:, None]).reshape(-1)
        if np.isnan(acc).any():
            raise InputError("BeamSearch.step: the scores are NaN (NaN or +inf logits from the model)")
        # c. top-k continuations over all beams
        idx = _topk(acc, k)
        top_scores = acc[idx]
        parent = idx // vocab
        tokens = idx % vocab
        cand = self._running[parent]  # fancy indexing copies
        cand[:, cur] = tokens
        # d. which candidates hit a stopping criterion (max length, EOS)
        hits = np.isin(tokens, self._eos) | (cur + 1 >= self.max_length)
        # e. the best num_beams unfinished candidates run on
        run_lp = top_scores + hits.astype(np.float32) * _NEG
        nxt = _topk(run_lp, nb)
        self._running = cand[nxt]
        self._run_scores = run_lp[nxt]
        parents = parent[nxt].tolist()
        # f. finished: the top num_beams candidates that ended, length-normalized, merged with the finished set
        did = hits & self._top_mask
        fs = top_scores / np.float32((cur + 1 - plen) ** s.length_penalty)
        full = bool(self._fin_done.all()) and s.early_stopping is True
        fs = fs + np.float32(full) * _NEG
        fs = fs + np.float32(not self._unsat) * _NEG
        fs = fs + (~did).astype(np.float32) * _NEG
        m_scores = np.concatenate([self._fin_scores, fs])
        sel = _topk(m_scores, nb)
        self._fin_seqs = np.concatenate([self._fin_seqs, cand])[sel]
        self._fin_scores = m_scores[sel]
        self._fin_done = np.concatenate([self._fin_done, did])[sel]
        self._fin_len = np.concatenate([self._fin_len, np.full(k, cur + 1, dtype=np.int64)])[sel]
        # g. HF's loop condition
        self.cur_len = cur = cur + 1
        self.steps += 1
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = self.max_length - plen
        else:
            best_len = cur - plen
        best = self._run_scores[0] / np.float32(best_len**s.length_penalty)
        worst = np.where(self._fin_done, self._fin_scores.min(), _NEG)
        self._unsat = self._unsat and bool((best > worst).any())
        exists_open = not (bool(self._fin_done.all()) and s.early_stopping is True)
        valid = not bool(hits.all())
        self.done = not (self._unsat and exists_open and valid)
        return parents

    def results(self) -> list[tuple[list[int], float]]:
        """The best ``num_return_sequences`` finished hypotheses, best first: (tokens, HF's sequences_scores)."""
        if not self.done:
            raise UsageError("beam search is not done yet; step() until done")
        r = self.settings.num_return_sequences
        return [
            (self._fin_seqs[i, : self._fin_len[i]].tolist(), float(self._fin_scores[i])) for i in range(r)
        ]

    def padded_results(self) -> tuple[np.ndarray, np.ndarray]:
        """HF's ``sequences`` ([num_return_sequences, prompt + longest generated], short rows filled with
        ``beam_fill_token_id``) and ``sequences_scores`` (float32)."""
        if not self.done:
            raise UsageError("beam search is not done yet; step() until done")
        r = self.settings.num_return_sequences
        width = int(self._fin_len[:r].max())
        return self._fin_seqs[:r, :width].copy(), self._fin_scores[:r].copy()
