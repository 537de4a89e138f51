"""Structured outputs and tool calling through `precast serve`, driven by the official `openai` client over the
tiny random-weight Llama: response_format (json_object, json_schema, the client's pydantic ``parse``), vLLM's
guided_* keys, tools with every tool_choice (streamed and not), the tool / developer roles, and the 400s.

A random model's output only parses because the grammar constrains it: each check would fail unconstrained.
Schemas bound their strings, arrays and numbers so that outputs end well within the 256-token context."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from precast.runtime.server import ServerConfig
from tests.server.conftest import live_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

# A compact template (the default ChatML lists tools in a system block too long for a 256-token context); it
# shows what reached it: tool names, calls with their arguments as dicts, tool results with their call ids.
TEMPLATE = (
    "{% if tools %}{{ 'tools: ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{{ ' call ' + c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m['role'] == 'tool' %}{{ ' for ' + m['tool_call_id'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{{ 'assistant:' }}"
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s, "strict": True}}
    for n, s in SCHEMAS.items()
]
HI = [{"role": "user", "content": "hi"}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def server(llm_artifact, tmp_path_factory):
    from precast.artifact.manifest import sha256_file

    dest = tmp_path_factory.mktemp("structured") / "tiny-llama"
    shutil.copytree(llm_artifact, dest)
    cfg = dest / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": TEMPLATE}))
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer_config.json"] = sha256_file(cfg)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    with live_server(ServerConfig(dest, model_name="tiny", request_timeout=60, llm={"num_blocks": 64})) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def _valid(text: str, schema: dict):
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


# -- response_format ------------------------------------------------------------------------------------
def test_json_schema_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model="tiny", messages=HI, response_format=fmt, max_tokens=120, n=3, seed=1, temperature=1.0
    )
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c
        _valid(c.message.content, PERSON)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not one forced answer
    r = client.completions.create(
        model="tiny", prompt="x", max_tokens=120, n=2, seed=2, extra_body={"response_format": fmt}
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        _valid(c.text, PERSON)


def test_json_object_on_chat_and_completions(client):
    fmt = {"type": "json_object"}
    r = client.chat.completions.create(
        model="tiny", messages=HI, response_format=fmt, max_tokens=120, n=4, seed=3
    )
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done  # a random model closes its object soon enough, at least once in 4
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(
        model="tiny", prompt="x", max_tokens=120, n=4, seed=3, extra_body={"response_format": fmt}
    )
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.text), dict) for c in done)


def test_the_clients_pydantic_parse_returns_a_parsed_object(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)
        ok: bool

    r = client.chat.completions.parse(
        model="tiny", messages=HI, response_format=Person, max_tokens=80, seed=4
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and len(parsed.name) <= 6 and 0 <= parsed.age <= 120


# -- vLLM's guided_* ----------------------------------------------------------------------------------------
def test_guided_regex_choice_grammar_and_json(client):
    pattern = r"[a-c]{2,5}-[0-9]{1,3}"
    for seed in range(3):
        r = client.completions.create(
            model="tiny", prompt="x", max_tokens=20, seed=seed, extra_body={"guided_regex": pattern}
        )
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    choices = ["yes", "no", "maybe"]
    r = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=10, n=4, seed=5, extra_body={"guided_choice": choices}
    )
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    grammar = 'start: greet " " name\ngreet: "hi" | "hello"\nname: /[a-z]{1,5}/\n'
    r = client.completions.create(
        model="tiny", prompt="x", max_tokens=20, n=3, seed=6, extra_body={"guided_grammar": grammar}
    )
    assert all(re.fullmatch(r"(hi|hello) [a-z]{1,5}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(
        model="tiny", prompt="x", max_tokens=60, seed=7, extra_body={"guided_json": json.dumps(WEATHER)}
    )
    _valid(r.choices[0].text, WEATHER)


def test_min_p_one_keeps_only_the_top_token(client):
    greedy = client.completions.create(model="tiny", prompt="x = [", max_tokens=8, temperature=0)
    hot = client.completions.create(
        model="tiny", prompt="x = [", max_tokens=8, temperature=1.5, seed=9, extra_body={"min_p": 1.0}
    )
    assert hot.choices[0].text == greedy.choices[0].text
    free = client.completions.create(model="tiny", prompt="x = [", max_tokens=8, temperature=1.5, seed=9)
    assert free.choices[0].text != greedy.choices[0].text  # (so min_p is what made them equal)


# -- tools --------------------------------------------------------------------------------------------------
def _check_call(call) -> None:
    assert CALL_ID.match(call.id) and call.type == "function"
    _valid(call.function.arguments, SCHEMAS[call.function.name])


def test_tool_choice_required_gives_one_valid_call_per_choice(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        n=3,
        seed=10,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0])
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3


def test_tool_choice_required_streamed_as_openai_streams_calls(client):
    kwargs = dict(
        model="tiny",
        messages=HI,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    with client.chat.completions.stream(**kwargs, seed=11) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call)
    assert call.function.parsed_arguments == json.loads(
        call.function.arguments
    )  # strict tools: the client parses
    # the raw chunks: the call's id and name first (empty arguments), then its arguments, then the finish
    chunks = list(client.chat.completions.create(**kwargs, seed=11, stream=True, n=2))
    deltas = {0: [], 1: []}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            if c.delta.tool_calls:
                deltas[c.index] += c.delta.tool_calls
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    first, rest = deltas[0][0], deltas[0][1:]
    assert first.index == 0 and CALL_ID.match(first.id) and first.function.arguments == ""
    args = "".join(d.function.arguments for d in rest)
    assert json.loads(args) == json.loads(call.function.arguments)  # same seed as the stream above
    assert first.function.name == call.function.name


def test_named_tool_choice_forces_that_function(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=40,
        n=2,
        seed=12,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "add"
        _check_call(call)


def test_tool_choice_auto_and_none_give_plain_content_from_a_random_model(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model="tiny", messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0
        )
        m = r.choices[0].message
        assert m.tool_calls is None and isinstance(m.content, str) and m.content
        assert r.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(
        model="tiny", messages=HI, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert plain.choices[0].message.content == m.content  # auto is the default with tools


def test_tool_role_developer_role_and_assistant_calls_are_accepted(client, server):
    args = json.dumps({"city": "Paris", "days": 2})
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant"
    # what the template saw: developer as system, the call's arguments as a dict, the tool result's call id
    svc = server[1].host.current.llm
    clean = svc.clean_messages(msgs)
    text = svc.text.call("chat", {"messages": clean, "tools": TOOLS, "encode": False}).result(30)["text"]
    assert text == (
        "tools: get_weather add \nsystem: be brief\nuser: weather?\n"
        'assistant:  call get_weather{"city": "Paris", "days": 2}\ntool: sunny for call_1\nassistant:'
    )
    assert r.usage.prompt_tokens == len(svc.engine.tokenizer.encode(text))
    bad = [*msgs[:3], {"role": "tool", "tool_call_id": "call_2", "content": "x"}]
    r = _post(server, "chat/completions", {"messages": bad, "max_tokens": 2})
    assert r.status_code == 400 and "messages[3].tool_call_id" in r.json()["error"]["message"], r.text
    bad = [
        *msgs[:2],
        {
            **msgs[2],
            "tool_calls": [{**msgs[2]["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}],
        },
    ]
    r = _post(server, "chat/completions", {"messages": bad, "max_tokens": 2})
    assert r.status_code == 400 and "messages[2].tool_calls[0].function.arguments" in r.text
    # a response's message appended whole (the client's model_dump(): empty annotations / audio / function_call)
    dumped = {**msgs[2], "refusal": None, "annotations": [], "audio": None, "function_call": None}
    r = _post(server, "chat/completions", {"messages": [*msgs[:2], dumped, msgs[3]], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_default_chatml_lists_tools_and_calls():
    from precast.runtime.server.llm_service import DEFAULT_CHAT_TEMPLATE, LLMService
    from precast.runtime.server.text_sandbox import TextSandbox

    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    clean = LLMService.clean_messages(None, msgs)
    plain = TextSandbox(template=None, tokenizer=None).start()
    jinja = TextSandbox(template=DEFAULT_CHAT_TEMPLATE, tokenizer=None).start()
    try:
        for tools in (TOOLS, None):
            args = {"messages": clean, "tools": tools, "encode": False}
            text = plain.call("chat", args).result(30)["text"]
            assert jinja.call("chat", args).result(30)["text"] == text
        with_tools = plain.call("chat", {"messages": clean, "tools": TOOLS, "encode": False}).result(30)[
            "text"
        ]
    finally:
        plain.close()
        jinja.close()
    system = with_tools.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nbe brief\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(t)["function"]["name"] for t in listed] == ["get_weather", "add"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in with_tools
    assert "<|im_start|>tool\n<tool_response>\n2\n</tool_response><|im_end|>" in with_tools
    assert with_tools.count("be brief") == 1 and text.count("<|im_start|>system\nbe brief<|im_end|>") == 1


def test_tool_call_parsing_of_crafted_text():
    from precast.runtime.server.tool_calls import parse_tools

    auto = parse_tools({"tools": TOOLS})
    assert auto.choice == "auto" and auto.schema() is None
    content, calls = auto.parse(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 1}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(CALL_ID.match(c.id) for c in calls) and calls[0].id != calls[1].id
    _, calls = auto.parse('{"name": "add", "parameters": {"a": 3, "b": 4}}')  # Llama 3.1's spelling
    assert calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 3, "b": 4}
    _, calls = auto.parse('```json\n[{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}]\n```')
    assert json.loads(calls[0].arguments) == {"a": 5, "b": 6}
    for text in (
        "plain words",
        '{"name": "nope", "arguments": {}}',  # not a tool of the request
        '{"a": 1}',
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # cut short
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed
        '{"name": "add", "arguments": [1]}',
    ):
        assert auto.parse(text) is None, text
    single = parse_tools({"tools": TOOLS, "parallel_tool_calls": False})
    _, calls = single.parse('[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}]')
    assert len(calls) == 1
    assert (
        parse_tools({"tools": TOOLS, "tool_choice": "none"}).parse('{"name": "add", "arguments": {}}') is None
    )
    required = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = required.schema()
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_weather", "parameters": {"city": "a", "days": 2}}]'
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"city": "a", "days": 2}}], schema)
    assert required.parse(text)[1][0].name == "get_weather" and required.parse(text[:-2]) is None
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.schema() == ADD
    assert named.parse('{"a": 1, "b": 2}')[1][0].name == "add" and named.parse('{"a": 1') is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None


def test_auto_calls_streamed_are_accumulated_by_the_openai_client():
    """ChatServing holds an auto choice's text back and streams what it parses as OpenAI does (content, then per
    call its id + name and its arguments); the client's own stream accumulator rebuilds the message."""
    from types import SimpleNamespace

    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from precast.runtime.server.serving_llm import ChatServing, _Run
    from precast.runtime.server.tool_calls import parse_tools

    text = (
        'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    )
    req = SimpleNamespace(tools=parse_tools({"tools": TOOLS}))
    run = _Run("chatcmpl-x", req, None, [None], 3, 0, [""])
    serving = ChatServing(SimpleNamespace(name="tiny"))
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    chunks = []
    for i, piece in enumerate(pieces):
        ev = SimpleNamespace(
            text=piece, finish_reason="stop" if i == len(pieces) - 1 else None, logprobs=None
        )
        out = serving.event_choices(run, 0, ev)
        assert out == [] or i == len(pieces) - 1  # held back until the choice ends
        chunks += [serving._chunk(run, [c]) for c in out]
    state = ChatCompletionStreamState()
    for c in serving.opening_chunks(run) + chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    (choice,) = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo", "days": 3}),
    ]
    assert all(CALL_ID.match(c.id) for c in calls)
    # the same text, not streamed
    body = serving.choice(run, 0, text, "stop", None)
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] == "Sure."
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["add", "get_weather"]


# -- 400s -----------------------------------------------------------------------------------------------
def _fn(**f):
    return [{"type": "function", "function": f}]


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}


@pytest.mark.parametrize(
    "route, extra, param, needle",
    [
        ("chat", {"response_format": BAD_SCHEMA}, "response_format", "invalid json schema"),
        ("completions", {"response_format": BAD_SCHEMA}, "response_format", "invalid json schema"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format",
            "name",
        ),
        ("chat", {"response_format": {"type": "xml"}}, "response_format", "type"),
        ("chat", {"response_format": "json"}, "response_format", "object"),
        ("chat", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ("chat", {"guided_choice": []}, "guided_choice", "non-empty list"),
        ("completions", {"guided_regex": "("}, "guided_regex", "invalid regex"),
        ("completions", {"guided_grammar": "start: nothing_defined"}, "guided_grammar", "nothing_defined"),
        ("completions", {"frobnicate": 1}, "frobnicate", "frobnicate"),
        ("chat", {"extra_thing": None}, "extra_thing", "extra_thing"),
        ("completions", {"temperature": 3}, "temperature", "temperature"),
        ("completions", {"min_p": 2}, "min_p", "min_p"),
        (
            "chat",
            {"guided_regex": "a+", "response_format": {"type": "json_object"}},
            "guided_regex",
            "response_format",
        ),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]},
            "tool_choice",
            "guided_choice",
        ),
        (
            "chat",
            {"guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern",
        ),
        ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        ("chat", {"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0]"),
        ("chat", {"tools": _fn(name="bad name!")}, "tools", "name"),
        ("chat", {"tools": _fn(name="f", parameters={"type": "array"})}, "tools", "parameters"),
        ("chat", {"tools": _fn(name="f", extra=1)}, "tools", "extra"),
        ("chat", {"tools": _fn(name="f") + _fn(name="f")}, "tools", "more than once"),
        ("chat", {"tools": "f"}, "tools", "list"),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ("chat", {"tool_choice": "required"}, "tool_choice", "tools"),
        ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        (
            "chat",
            {
                "tools": _fn(name="f", parameters={"type": "object", "properties": {"x": {"type": "foo"}}}),
                "tool_choice": "required",
            },
            "tools",
            "invalid json schema",
        ),
        ("completions", {"tools": TOOLS}, "tools", "chat"),
        (
            "chat",
            {"tools": _fn(name="f", parameters={"type": "object", "properties": {"x": {"type": "foo"}}})},
            "tools",
            "tools[0].function.parameters': invalid json schema",
        ),
        ("chat", {"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi", "foo": 1}]},
            "messages",
            "unknown key(s) 'foo'",
        ),
        (
            "chat",
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "nope"}]},
            "messages",
            "tool_call_id",
        ),
        ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when 'tools'"),
        ("chat", {"store": True}, "store", "not supported"),
        ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
        ("chat", {"ignore_eos": True, "guided_regex": "a"}, "ignore_eos", "constraint"),
        ("chat", {"guided_regex": "[^\\s\\S]"}, "guided_regex", "matches no output"),
        ("completions", {"guided_grammar": 'start: a\na: a "x"\n'}, "guided_grammar", "matches no output"),
        ("chat", {"guided_json": False}, "guided_json", "matches no output"),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "big", "schema": {"enum": ["x" * 70000]}},
                }
            },
            "response_format",
            "characters; at most",
        ),
    ],
)
def test_bad_structured_requests_are_400_naming_the_parameter(server, route, extra, param, needle):
    base = {"messages": HI} if route == "chat" else {"prompt": "hi"}
    r = _post(
        server, "chat/completions" if route == "chat" else "completions", base | {"max_tokens": 4} | extra
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_harmless_openai_parameters_are_accepted(server):
    body = {
        "messages": HI,
        "max_tokens": 2,
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "response_format": {"type": "text"},
        "guided_decoding_backend": "llguidance",
        "min_p": 0.1,
    }
    assert _post(server, "chat/completions", body).status_code == 200


def test_a_grammar_that_fails_mid_way_is_a_400_naming_it_and_the_server_goes_on(server, monkeypatch):
    """A grammar over its per-step limits (here: a tiny Earley row budget) fails its own request: a 400 naming
    the parameter (streamed: an OpenAI error event), never a 200 with finish_reason "error"; the next request
    is served."""
    from precast.runtime.llm import structured

    monkeypatch.setattr(structured, "_MAX_ITEMS_IN_ROW", 3)
    for i, stream in enumerate((False, True)):
        grammar = (
            f"start: item+\nitem: a | b\na: x x\nb: x\nx: NUM{i} | WORD\nNUM{i}: /[0-9]+/\nWORD: /[a-z]+/\n"
        )
        body = {"messages": HI, "max_tokens": 40, "seed": 0, "temperature": 1.0, "guided_grammar": grammar}
        if not stream:
            r = _post(server, "chat/completions", body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
        else:
            with httpx.stream(
                "POST",
                f"{server[0]}/v1/chat/completions",
                json={"model": "tiny", "stream": True, **body},
                timeout=60,
            ) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            err = next(e["error"] for e in events if "error" in e)
        assert err["param"] == "guided_grammar" and "structured output failed" in err["message"], err
        assert "\n" not in err["message"]
    monkeypatch.undo()
    r = _post(server, "chat/completions", {"messages": HI, "max_tokens": 4})
    assert r.status_code == 200


def test_a_constraint_without_max_tokens_is_not_cut_at_16(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(
        model="tiny", messages=HI, response_format=fmt, seed=3, temperature=1.0
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    _valid(r.choices[0].message.content, PERSON)
    assert r.usage.completion_tokens > 16
