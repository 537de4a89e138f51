"""Structured outputs in the engine (runtime/llm/structured.py): a random-weight tiny Llama (N(0, 0.1)) under a
grammar always gives output that parses and validates; free requests in the same batch are untouched."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from precast.errors import LLMRequestError  # noqa: E402
from precast.runtime.llm import Engine, SamplingParams, SchedulerConfig  # noqa: E402
from precast.runtime.llm.structured import MAX_SPEC_CHARS, Constraint  # noqa: E402

PROMPTS = ["def f(x):", "import os\n", "class A:\n    ", "x = [1, 2", "Hello, world", "# a comment"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory, compiled):
    """The tiny Llama with a 1024-token context (JSON outputs of a random model can be long)."""
    pytest.importorskip("transformers")
    from tests.llm.fixtures import build_llama

    folder = build_llama(tmp_path_factory.mktemp("llm") / "llama-1k", max_position_embeddings=1024)
    return compiled(folder, targets=("ort-cpu",), task="causal-lm").output


@pytest.fixture(scope="module")
def engine(llama):
    eng = Engine.load(llama, num_blocks=512)
    yield eng
    eng.close()


# -- a corpus of JSON schemas ----------------------------------------------------------------------------
def _leaf(rng) -> dict:
    kind = rng.integers(9)
    if kind == 0:
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 1000))}
    if kind == 1:
        return {"type": "number", "minimum": -10.5, "maximum": float(rng.integers(1, 100))}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"enum": [str(w) for w in rng.choice(["red", "green", "blue", "x", "long value"], 3, False)]}
    if kind == 4:
        return {"type": "string", "maxLength": int(rng.integers(0, 10))}
    if kind == 5:
        return {
            "type": "string",
            "pattern": ["^[a-z]{1,6}$", "^[A-Z][0-9]{2}$", "^(ab|cd)+$"][rng.integers(3)],
        }
    if kind == 6:
        return {"type": "null"}
    if kind == 7:
        return {"const": ["fixed", 3, True][rng.integers(3)]}
    return {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7, "multipleOf": 2}


def _schema(rng, depth: int) -> dict:
    kind = rng.integers(5) if depth > 0 else 0
    if kind <= 1:
        return _leaf(rng)
    if kind == 2:  # array
        return {"type": "array", "items": _schema(rng, depth - 1), "maxItems": int(rng.integers(1, 4))}
    if kind == 3:  # anyOf
        return {"anyOf": [_schema(rng, depth - 1), _leaf(rng)]}
    n = int(rng.integers(1, 5))
    props = {f"p{i}_{rng.integers(100)}": _schema(rng, depth - 1) for i in range(n)}
    req = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def schema_corpus(count: int = 200, seed: int = 0) -> list[dict]:
    """``count`` schemas: objects, arrays, enums, consts, anyOf, bounded numbers, string patterns and lengths;
    every fifth one puts a definition behind a nested ``$ref``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        s = _schema(rng, 3)
        if s.get("type") != "object":
            s = {"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}
        if i % 5 == 0:  # nested refs: a $defs entry that itself refers to another
            s = {
                "$defs": {
                    "point": {
                        "type": "object",
                        "properties": {
                            "x": {"type": "integer", "minimum": 0, "maximum": 9},
                            "tag": {"$ref": "#/$defs/tag"},
                        },
                        "required": ["x", "tag"],
                        "additionalProperties": False,
                    },
                    "tag": {"enum": ["a", "b"]},
                },
                "type": "object",
                "properties": {**s["properties"], "pt": {"$ref": "#/$defs/point"}},
                "required": [*s.get("required", []), "pt"],
                "additionalProperties": False,
            }
        out.append(s)
    return out


@pytest.mark.slow
def test_json_schema_corpus_every_output_validates(engine):
    """200 schemas x 4 sampling seeds (temperature 1: the random model wanders through the grammar)."""
    schemas = schema_corpus()
    kinds = {
        k
        for s in schemas
        for k in json.dumps(s).replace('"', " ").split()
        if k in ("$ref", "anyOf", "pattern", "enum")
    }
    assert kinds == {"$ref", "anyOf", "pattern", "enum"}
    handles = []
    for seed in range(4):
        for i, s in enumerate(schemas):
            p = SamplingParams(
                max_tokens=400, temperature=1.0, seed=seed * 1000 + i, constraint=Constraint.json_schema(s)
            )
            handles.append((s, engine.submit(PROMPTS[i % len(PROMPTS)], p)))
    engine.run_until_done()
    bad = []
    for s, h in handles:
        c = h.result()
        try:
            jsonschema.validate(json.loads(c.text), s)
            assert c.finish_reason == "stop"
        except Exception as e:  # noqa: BLE001  (collect every failure, then report)
            bad.append((c.finish_reason, c.text[:120], str(e)[:120]))
    assert not bad, f"{len(bad)} of {len(handles)} outputs fail: {bad[:3]}"
    distinct = len({json.dumps(s) for s in schemas})  # (the random corpus repeats a few small schemas)
    assert engine.grammars.compiled == distinct and engine.grammars.cache_hits == len(handles) - distinct


def test_regex_choice_and_grammar_outputs_match(engine):
    cases = [
        (Constraint.regex(r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (Constraint.choice(["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
        (
            Constraint.grammar('start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]{1,3}/\n'),
            lambda t: re.fullmatch(r"\((\d{1,3}\+)*\d{1,3}\)", t),
        ),
    ]
    for c, ok in cases:
        for seed in range(6):
            out = engine.generate(
                [PROMPTS[seed]], SamplingParams(max_tokens=100, temperature=1.0, seed=seed, constraint=c)
            )[0]
            assert ok(out.text) and out.finish_reason == "stop", (c.kind, out.text)


@pytest.mark.parametrize("grammar_thread", [False, True])
def test_free_requests_in_a_mixed_batch_keep_their_tokens(engine, grammar_thread, monkeypatch):
    """8 requests, half under a schema: the free ones give the tokens they give alone (greedy and seeded),
    with the masks computed in the step loop or on the grammar thread beside the backend."""
    monkeypatch.setattr(engine, "grammar_thread", grammar_thread)
    free = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5),
    ]
    schema = Constraint.json_schema(
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 999},
                    "maxItems": 4,
                }
            },
            "required": ["a"],
            "additionalProperties": False,
        }
    )
    constrained = [
        SamplingParams(max_tokens=200, temperature=1.0 if i % 2 else 0.0, seed=i, constraint=schema)
        for i in range(4)
    ]
    alone = [engine.generate([PROMPTS[i]], free[i % 2])[0].token_ids for i in range(4)]
    alone_c = [engine.generate([PROMPTS[i + 1]], constrained[i])[0].token_ids for i in range(4)]
    handles = []
    for i in range(4):
        handles.append(engine.submit(PROMPTS[i], free[i % 2]))
        handles.append(engine.submit(PROMPTS[i + 1], constrained[i]))
    engine.run_until_done()
    assert [h.result().token_ids for h in handles[0::2]] == alone
    assert [h.result().token_ids for h in handles[1::2]] == alone_c  # (seeded draws: their own generators)
    for h in handles[1::2]:
        assert isinstance(json.loads(h.result().text)["a"], list)


def test_constrained_greedy_survives_preemption(llama):
    """A tight pool (6 blocks of 64 for 6 requests of 50-80 tokens) preempts and recomputes: the constrained
    outputs are the ones of a roomy pool."""
    schema = Constraint.json_schema(
        {
            "type": "object",
            "properties": {
                "s": {"type": "string", "minLength": 20, "maxLength": 40},
                "n": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 100, "maximum": 999},
                    "minItems": 6,
                },
            },
            "required": ["s", "n"],
            "additionalProperties": False,
        }
    )
    params = SamplingParams(max_tokens=120, constraint=schema)
    roomy = Engine.load(llama, num_blocks=256)
    want = [c.token_ids for c in roomy.generate(PROMPTS, params)]
    roomy.close()
    tight = Engine.load(llama, num_blocks=6, config=SchedulerConfig(max_num_batched_tokens=32))
    got = [c.token_ids for c in tight.generate(PROMPTS, params)]
    preempted = tight.metrics().preemptions
    tight.close()
    assert got == want
    assert preempted > 0


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: Constraint.json_schema({"type": "foo"}), "invalid json schema: Invalid type: foo"),
        (lambda: Constraint.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
        (lambda: Constraint.json_schema({"type": "string", "format": "weird"}), "Unknown format"),
        (lambda: Constraint.json_schema({"properties": {"a": {"$ref": "#/$defs/nope"}}}), "does not exist"),
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.regex("a(b"), "invalid regex"),
        (lambda: Constraint.grammar("start: x\n"), "invalid grammar"),
        (lambda: Constraint.choice([]), "non-empty list"),
        (lambda: Constraint.json_schema({"enum": ["x" * (MAX_SPEC_CHARS + 1)]}), "characters; at most"),
        (lambda: Constraint.json_schema(False), "json schema false matches no output"),
        (lambda: Constraint.regex(r"[^\s\S]"), "regex matches no output"),
        (lambda: Constraint.grammar('start: a\na: a "x"\n'), "grammar matches no output"),
    ],
)
def test_bad_constraints_are_refused_before_any_token(engine, make, needle):
    before = engine.counters.requests_rejected
    with pytest.raises(LLMRequestError, match=re.escape(needle)):
        engine.submit("x", SamplingParams(constraint=make()))
    assert not engine.has_unfinished()
    # (a Constraint that cannot even be built raises before submit: only the others count as rejected)
    assert engine.counters.requests_rejected - before in (0, 1)


def test_constraint_with_ignore_eos_is_refused(engine):
    with pytest.raises(LLMRequestError, match="ignore_eos cannot be combined"):
        engine.submit("x", SamplingParams(ignore_eos=True, constraint=Constraint.json_object()))


def test_compiled_grammars_are_cached_per_constraint(engine):
    c = Constraint.json_schema(
        {"type": "object", "properties": {"only_here": {"type": "boolean"}}, "required": ["only_here"]}
    )
    compiled, hits = engine.grammars.compiled, engine.grammars.cache_hits
    engine.generate(["a", "b", "c"], SamplingParams(max_tokens=40, constraint=c))
    assert engine.grammars.compiled == compiled + 1
    assert engine.grammars.cache_hits == hits + 2


def test_generate_cli_json_schema(cli, llama, tmp_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    (tmp_path / "s.json").write_text(json.dumps(schema))
    r = cli(
        "generate", llama, "hello", "--json-schema", tmp_path / "s.json", "--temperature", "1", "--seed", "4"
    )
    assert r.code == 0, r.err
    jsonschema.validate(json.loads(r.out), schema)
    assert "finish: stop" in r.err
    r = cli("generate", llama, "hi", "--choice", "yes", "--choice", "no", "--temperature", "1", "--seed", "1")
    assert r.code == 0 and r.out.strip() in ("yes", "no")
    (tmp_path / "bad.json").write_text('{"type": "foo"}')
    for args, needle in [
        (("--json-schema", tmp_path / "bad.json"), "bad.json: invalid json schema: Invalid type: foo"),
        (("--regex", "[^\\s\\S]"), "--regex: regex matches no output"),
        (("--json-schema", tmp_path / "missing.json"), "--json-schema"),
        (("--regex", "a(b"), "invalid regex"),
        (("--regex", "a", "--choice", "b"), "--regex and --choice: give at most one"),
    ]:
        r = cli("generate", llama, "hi", *args)
        assert r.code != 0 and needle in r.err and "Traceback" not in r.err, (args, r.err)
        assert len(r.err.strip().splitlines()) == 1


def test_a_grammar_over_its_step_budget_fails_alone(llama, monkeypatch):
    """llguidance's per-step fuel bounds a mask's work: a request whose grammar needs more fails with one line
    (finish "error"), while a free request and a cheap constrained one in the same batch finish as alone."""
    from precast.runtime.llm import structured

    eng = Engine.load(llama, num_blocks=64)
    free = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = eng.generate([PROMPTS[0]], free)[0].token_ids
    monkeypatch.setattr(structured, "_MAX_ITEMS_IN_ROW", 3)  # a tiny Earley budget per step
    heavy = Constraint.grammar(
        "start: item+\nitem: a | b\na: x x\nb: x\nx: NUM | WORD\nNUM: /[0-9]+/\nWORD: /[a-z]+/\n"
    )
    eng.grammars._cache.clear()
    try:
        h_heavy = eng.submit(
            PROMPTS[1], SamplingParams(max_tokens=60, temperature=1.0, seed=0, constraint=heavy)
        )
    except LLMRequestError as e:  # (refused at compile: also bounded, before any token)
        h_heavy, refused = None, str(e)
    h_free = eng.submit(PROMPTS[0], free)
    eng.run_until_done()
    assert h_free.result().token_ids == alone
    if h_heavy is not None:
        with pytest.raises(LLMRequestError, match="structured output failed: Parser Error: Current row has"):
            h_heavy.result()
        assert "\n" not in h_heavy.error
    else:
        assert "invalid grammar" in refused
    eng.close()


def test_a_mask_over_its_time_limit_fails_its_request_alone(engine, monkeypatch):
    """The wall-clock backstop (an injected clock: every mask 'takes' 40 ms, over MAX_MASK_SECONDS)."""
    from precast.runtime.llm import structured

    ticks = iter(range(10**6))
    monkeypatch.setattr(engine.grammars, "clock", lambda: next(ticks) * 0.02)  # 2 reads a mask: 20 ms apart
    monkeypatch.setattr(structured, "MAX_MASK_SECONDS", 0.015)
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([PROMPTS[2]], free)[0].token_ids
    h = engine.submit(PROMPTS[1], SamplingParams(max_tokens=40, constraint=Constraint.json_object()))
    h_free = engine.submit(PROMPTS[2], free)
    engine.run_until_done()
    assert h_free.result().token_ids == alone
    with pytest.raises(LLMRequestError, match=r"took 20 ms to mask one token \(limit 15 ms\)"):
        h.result()


def test_true_schema_allows_any_json(engine):
    """``true`` (the schema every value satisfies) is ``{}``: any JSON value, not an error."""
    c = Constraint.json_schema(True)
    assert c == Constraint.json_schema({}) == Constraint.json_schema("true")
    out = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=300, temperature=1.0, seed=2, constraint=c)
    )[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        json.loads(out.text)
