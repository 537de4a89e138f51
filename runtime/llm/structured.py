"""Structured outputs: a per-request grammar that masks the logits, so every output parses.

A request's ``SamplingParams.constraint`` is a ``Constraint`` (a JSON schema, any JSON object, a regex, one of
a list of strings, or a Lark grammar). The grammar engine is llguidance (Rust, numpy bitmasks, no torch: the
runtime stays torch-free); it is an optional extra (``pip install 'precast[structured]'``).

    Engine.submit          Grammars.matcher(constraint)    compile (cached per constraint) + a deep copy per
                                                           request; a bad or unsatisfiable one -> LLMRequestError
    Engine._step           Grammars.masks(matchers)        the next-token bitmasks of the constrained rows (on a
                                                           grammar thread beside the backend's step when a core
                                                           is spare, else after it), and why any row must fail
                           mask_bias(mask, vocab)          disallowed tokens -> -inf, added to the logits (a
                                                           greedy row whose argmax ``allows`` keeps its own)
                           matcher.consume_token(tok)      after sampling; a grammar that is complete ends the
                                                           request ("stop")

Bounded work: the constraint's text is capped (``MAX_SPEC_CHARS``), compiling runs in the submitting thread
(never in the step loop), and llguidance's per-step limits and a wall-clock limit (``MAX_MASK_SECONDS``) bound
each mask: a grammar that needs more fails its own request with a one-line error, the others go on.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from precast.errors import LLMRequestError, first_line

__all__ = [
    "FAILED",
    "KINDS",
    "MAX_SPEC_CHARS",
    "Constraint",
    "Grammars",
    "allows",
    "mask_bias",
    "structured_available",
]

MAX_SPEC_CHARS = 64 * 1024  # a schema / grammar / regex / choice list, as text
MAX_CHOICES = 256
CACHE_SIZE = 256  # compiled grammars kept per engine
KINDS = ("json_schema", "regex", "choice", "grammar")
# How the error of a request its grammar failed mid-way begins (the server and the CLI recognise it by this)
FAILED = "structured output failed"

# Per-step work bounds: a grammar that needs more fails its request instead of stalling the batch. llguidance's
# default of 50k Earley items let one ambiguous grammar (start: e; e: e "+" e | e e | /[a-z]/) take 0.6 s for a
# single mask; at 5k the worst mask measured ~20 ms and the grammar failed within 60 tokens. JSON schemas use
# far fewer items (the tests' 200-schema corpus runs at 2k). MAX_MASK_SECONDS is the wall-clock backstop: a
# request whose mask took longer fails (its matcher's work per token is what the others wait for).
_STEP_LEXER_FUEL = 100_000
_STEP_MAX_ITEMS = 5_000
MAX_MASK_SECONDS = 0.1  # (well above a real mask: ~0.1 ms; a descheduled thread must not fail a request)
_MAX_ITEMS_IN_ROW = 2_000  # an Earley row's branching (llguidance's default)
_INITIAL_LEXER_FUEL = 1_000_000
_MAX_GRAMMAR_SIZE = 200_000


def structured_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _need_llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise LLMRequestError(
            "structured outputs need the llguidance package: pip install 'precast[structured]'"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``spec`` is text: the schema as canonical JSON, the regex, the
    choices as a JSON list, the Lark grammar. Equal constraints share one compiled grammar."""

    kind: str
    spec: str

    @classmethod
    def json_schema(cls, schema) -> Constraint:
        """A JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            if len(schema) > 16 * MAX_SPEC_CHARS:  # (compacted below: the limit is on that)
                raise LLMRequestError(_too_long("json schema", len(schema)))
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise LLMRequestError(f"json schema is not valid JSON: {first_line(e)}") from None
        if schema is True:  # the schema that allows everything: any JSON value
            schema = {}
        if schema is False:
            raise LLMRequestError("json schema false matches no output")
        if not isinstance(schema, dict):
            raise LLMRequestError(f"json schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(
                schema, separators=(",", ":"), allow_nan=False
            )  # (key order kept: it is the output's)
        except (TypeError, ValueError) as e:
            raise LLMRequestError(f"json schema cannot be written as JSON: {first_line(e)}") from None
        if len(text) > MAX_SPEC_CHARS:
            raise LLMRequestError(_too_long("json schema", len(text)))
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise LLMRequestError(f"regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices) -> Constraint:
        if (
            not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise LLMRequestError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise LLMRequestError(f"choice has {len(choices)} strings; at most {MAX_CHOICES}")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        """A Lark grammar (llguidance's dialect: EBNF rules, /regex/ terminals, ``start`` the top rule)."""
        if not isinstance(lark, str) or not lark.strip():
            raise LLMRequestError("grammar must be a non-empty Lark grammar text")
        return cls("grammar", lark)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise LLMRequestError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise LLMRequestError(f"{self.kind} constraint must be non-empty text")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise LLMRequestError(_too_long(self.label, len(self.spec)))

    @property
    def label(self) -> str:
        return self.kind.replace("_", " ")

    def grammar_text(self, llguidance) -> str:
        """llguidance's grammar for this constraint."""
        M = llguidance.LLMatcher
        if self.kind == "json_schema":
            # compact JSON (no free whitespace: a model cannot pad its output with spaces forever)
            return M.grammar_from_json_schema(self.spec, defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            return M.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alts = " | ".join(json.dumps(c) for c in json.loads(self.spec))
            return M.grammar_from_lark(f"start: {alts}\n")
        return M.grammar_from_lark(self.spec)


def _too_long(what: str, n: int) -> str:
    return f"{what} has {n} characters; at most {MAX_SPEC_CHARS}"


class Grammars:
    """One engine's grammar side: its tokenizer for llguidance (made on first use), compiled grammars cached
    per constraint (LRU), the masks of a step."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self._tokenizer = tokenizer  # the engine's TextTokenizer (None: ids only, no structured outputs)
        self.vocab = int(vocab)
        self._eos = [int(t) for t in eos_ids]
        self._lltok = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.clock = time.perf_counter  # (tests inject one)
        self.compiled = 0  # grammars compiled (cache misses)
        self.cache_hits = 0

    def _ll(self):
        llg = _need_llguidance()
        if self._lltok is None:
            if self._tokenizer is None:
                raise LLMRequestError("structured outputs need the artifact's tokenizer (this one has none)")
            if not self._eos:
                raise LLMRequestError(
                    "structured outputs need an end-of-sequence token (the artifact has none)"
                )
            try:
                self._lltok = llg.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab, eos_token=self._eos
                )
            except Exception as e:  # (a tokenizer llguidance cannot read)
                raise LLMRequestError(
                    f"structured outputs: cannot use this tokenizer: {first_line(e)}"
                ) from None
        return llg, self._lltok

    def _limits(self, llg):
        return llg.LLParserLimits(
            step_lexer_fuel=_STEP_LEXER_FUEL,
            step_max_items=_STEP_MAX_ITEMS,
            max_items_in_row=_MAX_ITEMS_IN_ROW,
            initial_lexer_fuel=_INITIAL_LEXER_FUEL,
            max_grammar_size=_MAX_GRAMMAR_SIZE,
            verbose_errors=False,
        )

    def matcher(self, constraint: Constraint):
        """A fresh matcher for one request (a copy of the cached compiled one). LLMRequestError names a
        grammar that is invalid, uses what llguidance does not support, or matches nothing."""
        if not isinstance(constraint, Constraint):
            raise LLMRequestError(f"constraint must be a Constraint, got {type(constraint).__name__}")
        constraint.validate()
        with self._lock:
            base = self._cache.get(constraint)
            if base is not None:
                self._cache.move_to_end(constraint)
                self.cache_hits += 1
                return base.deep_copy()
        base = self._compile(constraint)  # (outside the lock: a big grammar takes a while)
        with self._lock:
            self._cache[constraint] = base
            self._cache.move_to_end(constraint)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self.compiled += 1
        return base.deep_copy()

    def _compile(self, constraint: Constraint):
        llg, tok = self._ll()
        try:
            grammar = constraint.grammar_text(llg)
        except (ValueError, TypeError) as e:
            raise LLMRequestError(f"invalid {constraint.label}: {first_line(e)}") from None
        limits = self._limits(llg)
        err = llg.LLMatcher.validate_grammar(grammar, tok, limits=limits)
        if err:
            raise LLMRequestError(f"invalid {constraint.label}: {_one_line(err)}")
        m = llg.LLMatcher(tok, grammar, log_level=0, limits=limits)
        if m.is_error():
            raise LLMRequestError(f"invalid {constraint.label}: {_one_line(m.get_error())}")
        # A grammar whose first step allows nothing matches nothing (e.g. a choice of strings this tokenizer
        # cannot spell); found now, as a 400, not after a token.
        mask = self.new_mask(1)
        probe = m.deep_copy()
        llg.numpy.fill_next_token_bitmask(probe, mask, 0)
        if not mask.any() or probe.is_error():
            raise LLMRequestError(f"{constraint.label} matches no output")
        return m

    def fill(self, matchers: list, mask: np.ndarray) -> list[float]:
        """Fill ``mask[i]`` with matcher ``i``'s next-token bitmask (the GIL is released while it works); returns
        the seconds each took (``clock``). In the calling thread: llguidance's LLExecutor (a rayon pool) kept a
        thread spinning after each call, which slowed every ONNX Runtime step (benchmarks/README.md)."""
        llg, _ = self._ll()
        fill, clock = llg.numpy.fill_next_token_bitmask, self.clock
        took = []
        for i, m in enumerate(matchers):
            t0 = clock()
            fill(m, mask, i)
            took.append(clock() - t0)
        return took

    def new_mask(self, rows: int) -> np.ndarray:
        return np.zeros((rows, (self.vocab + 31) // 32), dtype=np.int32)

    def masks(self, matchers: list) -> tuple[np.ndarray, list[str | None]]:
        """(mask, why): ``mask[i]`` the next-token bitmask of matcher ``i``; ``why[i]`` None, or why its request
        must fail: the grammar allows nothing, went over llguidance's per-step limits, or took longer than
        MAX_MASK_SECONDS for this one token."""
        mask = self.new_mask(len(matchers))
        took = self.fill(matchers, mask)
        why: list[str | None] = []
        for m, row, t in zip(matchers, mask, took):
            if m.is_error():
                why.append(first_line(m.get_error()))
            elif t > MAX_MASK_SECONDS:
                why.append(
                    f"the grammar took {1000 * t:.0f} ms to mask one token (limit {1000 * MAX_MASK_SECONDS:.0f} ms): "
                    "it is too ambiguous"
                )
            elif not row.any():
                why.append("the grammar allows no next token")
            else:
                why.append(None)
        return mask, why


_NEG_INF_BITS = np.array(-np.inf, np.float32).view(np.int32)


def mask_bias(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A [rows, words] int32 bitmask (bit j of word w: token 32 w + j allowed) as an additive float32 bias
    [rows, vocab], 0 or -inf: the bits unpacked to 0 / 1, minus 1 (0 / -1: all bits set), and-ed with -inf's
    bit pattern. Integer ops only: ~5x faster than a table lookup or a select (8 rows x 32k: ~60 us)."""
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return ((bits.view(np.int8) - np.int8(1)).astype(np.int32) & _NEG_INF_BITS).view(np.float32)


def allows(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return " ".join(lines)[:300] if lines else "rejected by the grammar engine"
