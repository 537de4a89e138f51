"""An OpenAI completions / chat request body -> what the engine runs, or a 400 naming the parameter.

Supported: model, prompt (a string, a list of strings, token ids, or a list of token-id lists) | messages (roles
system, developer (rendered as system), user, assistant (with ``tool_calls``), tool), max_tokens
(max_completion_tokens), n (1-8), temperature (0-2), top_p, seed, stop, presence_penalty, frequency_penalty,
logprobs (completions: 0-5; chat: true, with top_logprobs 0-20), stream, stream_options.include_usage, best_of
(== n), response_format (text, json_object, json_schema; completions too), tools / tool_choice /
parallel_tool_calls (chat; tool_calls.py); informational and accepted: user, metadata, safety_identifier,
prompt_cache_key / prompt_cache_retention / prompt_cache_options, store false, service_tier auto / default.
Extensions (vLLM's spellings, sent as ``extra_body``): top_k, min_p, repetition_penalty, ignore_eos, priority,
guided_json, guided_regex, guided_choice, guided_grammar (Lark), guided_decoding_backend (llguidance only).

Structured outputs: response_format, one guided_* key, or a forced tool call (tool_choice required / a named
function) becomes the request's ``Constraint`` (runtime/llm/structured.py): at most one per request (two: a 400
naming both); the engine compiles it before any token (a bad schema: a 400 naming the key it came from).

What precast does not implement is refused, never ignored: ``functions`` / ``function_call`` (use tools),
``logit_bias``, ``suffix``, ``echo``, ``best_of`` other than n, ``audio``, ``prediction``, ``web_search_options``,
``modalities`` (other than text), ``store`` true, ``reasoning_effort``, ``verbosity``, ``moderation``,
``guided_whitespace_pattern``, and any key this module does not know -> 400 with ``param`` set. A
``max_tokens`` that does not fit the context beside the prompt is a 400 naming the limit (OpenAI's behaviour);
without ``max_tokens`` the default (16; with a structured-output constraint: the rest of the context) is capped
to what fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from precast.errors import LLMRequestError

__all__ = [
    "MAX_CHOICES",
    "MAX_N",
    "MAX_PROMPTS",
    "ParamError",
    "Prepared",
    "parse",
    "prepare",
    "sampling_params",
]

MAX_N = 8  # choices per prompt
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_CHOICES = 64  # prompts x n: sequences one request may start
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for /v1/completions 'logprobs'
MAX_TOP_LOGPROBS = 20  # OpenAI's cap for chat 'top_logprobs'
DEFAULT_MAX_TOKENS = 16
DEFAULT_CONSTRAINED_MAX_TOKENS = 1 << 20  # capped to what the context holds


class ParamError(LLMRequestError):
    """A 400 naming the request parameter at fault (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Prepared:
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams  # noqa: F821  (runtime.llm.sampler, imported lazily)
    n: int
    priority: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token to report; None: no logprobs
    tools: ToolRequest | None = None  # noqa: F821  (tool_calls.py) chat tools: their calls are parsed from the output
    # the body key the params' constraint came from (a bad one is a 400 naming it)
    constraint_key: str | None = None

    def choice_params(self, index: int):
        """Choice ``index``'s params: with a seed, seed + index (reproducible, and different per choice)."""
        p = self.params
        return p if p.seed is None or index == 0 else dataclasses.replace(p, seed=p.seed + index)


# -- what precast does not do ------------------------------------------------------------------------
def _absent(v) -> bool:
    return v is None or v == [] or v == {}


_UNSUPPORTED = {  # parameter -> (is its value harmless?, why it is refused)
    "functions": (_absent, "the legacy function calling is not supported: use 'tools'"),
    "function_call": (
        lambda v: v is None or v == "none",
        "the legacy function calling is not supported: use 'tool_choice'",
    ),
    "logit_bias": (_absent, "logit_bias is not supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "store": (lambda v: v is None or v is False, "stored completions are not supported"),
    "service_tier": (
        lambda v: v in (None, "auto", "default"),
        "only service_tier 'auto' / 'default' is supported",
    ),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported (not a reasoning model)"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
    "guided_decoding_backend": (
        lambda v: v in (None, "", "auto", "llguidance", "guidance"),
        "the only guided decoding backend is llguidance",
    ),
    "guided_whitespace_pattern": (lambda v: v is None, "guided_whitespace_pattern is not supported"),
}
_UNSUPPORTED_COMPLETIONS = {
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
}

# Every key a body may hold (anything else is a 400 naming it, never ignored).
_COMMON_KEYS = frozenset(
    "model max_tokens max_completion_tokens n temperature top_p seed stop presence_penalty frequency_penalty "
    "logprobs stream stream_options user logit_bias response_format metadata store service_tier "
    "safety_identifier prompt_cache_key prompt_cache_retention prompt_cache_options "
    # extensions (vLLM's spellings)
    "top_k min_p repetition_penalty ignore_eos priority guided_json guided_regex guided_choice guided_grammar "
    "guided_decoding_backend guided_whitespace_pattern".split()
)
_CHAT_KEYS = frozenset(
    "messages top_logprobs tools tool_choice parallel_tool_calls functions function_call audio modalities "
    "prediction web_search_options reasoning_effort verbosity moderation".split()
)
_COMPLETION_KEYS = frozenset("prompt best_of suffix echo".split())


def refuse_unsupported(body: dict, chat: bool, extra: frozenset = frozenset()) -> None:
    """A 400 for a key this route does not know (``extra``: a caller's own keys) or a value precast refuses."""
    own, other = (_CHAT_KEYS, _COMPLETION_KEYS) if chat else (_COMPLETION_KEYS, _CHAT_KEYS)
    own = own | extra
    route = "/v1/chat/completions" if chat else "/v1/completions"
    for key in body:
        if key in _COMMON_KEYS or key in own:
            continue
        if key in other:
            if body[key] is None:
                continue
            where = "/v1/completions" if chat else "/v1/chat/completions"
            raise ParamError(f"'{key}' is a parameter of {where}, not of {route}", key)
        raise ParamError(f"'{key}' is not a parameter precast serve knows (of {route})", key)
    checks = _UNSUPPORTED if chat else {**_UNSUPPORTED, **_UNSUPPORTED_COMPLETIONS}
    for key, (ok, why) in checks.items():
        if key in body and not ok(body[key]):
            raise ParamError(f"'{key}': {why} by precast serve", key)


# -- sampling ----------------------------------------------------------------------------------------
def _number(body: dict, key: str, default, kind=float):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ParamError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    return kind(v)


def _stop(body: dict, max_stop_strings: int | None, max_stop_chars: int | None) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):  # "" is kept: validate() rejects it, as the CLI's --stop ''
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ParamError("'stop' must be a string or a list of strings", "stop")
    if max_stop_strings is not None and len(stop) > max_stop_strings:
        raise ParamError(
            f"'stop' has {len(stop)} strings; this server takes at most {max_stop_strings}", "stop"
        )
    longest = max(map(len, stop), default=0)
    if max_stop_chars is not None and longest > max_stop_chars:
        raise ParamError(
            f"'stop' has a string of {longest} characters; this server takes at most {max_stop_chars}", "stop"
        )
    return tuple(stop)


def _max_tokens_key(body: dict) -> str | None:
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return key
    return None


def _n(body: dict) -> int:
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise ParamError(f"'n' must be an integer 1-{MAX_N}, got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise ParamError(
            f"'best_of' ({best_of!r}) other than n ({n}) is not supported by precast serve", "best_of"
        )
    return n


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top alternatives to report per token (0: only the sampled token's logprob), or None."""
    if not chat:
        v = body.get("logprobs")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COMPLETION_LOGPROBS:
            raise ParamError(
                f"'logprobs' must be an integer 0-{MAX_COMPLETION_LOGPROBS}, got {v!r}", "logprobs"
            )
        return v
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise ParamError(f"'logprobs' must be true or false, got {on!r}", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ParamError(
                f"'top_logprobs' must be an integer 0-{MAX_TOP_LOGPROBS}, got {top!r}", "top_logprobs"
            )
        if not on:
            raise ParamError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def sampling_params(
    body: dict,
    max_stop_strings: int | None = None,
    max_stop_chars: int | None = None,
    chat: bool = False,
    constraint=None,
):
    """SamplingParams from an OpenAI body; stop strings bounded (every step searches the output for each).
    ``constraint``: the output's structured.Constraint (``constraint(body)``), or None."""
    from precast.runtime.llm.sampler import SamplingParams

    key = _max_tokens_key(body)
    # A structured output cut at 16 tokens never parses: without max_tokens it may run to the context's end
    # (OpenAI's chat default; _fit_max_tokens caps it to what fits), and the grammar ends it.
    default = DEFAULT_MAX_TOKENS if constraint is None else DEFAULT_CONSTRAINED_MAX_TOKENS
    max_tokens = default if key is None else body[key]
    if key is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ParamError(f"'{key}' must be a positive integer, got {max_tokens!r}", key)
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension, handy for benchmarks
    if not isinstance(ignore_eos, bool):
        raise ParamError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", "ignore_eos")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_number(body, "top_k", 0, int),
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        seed=_number(body, "seed", None, int),
        stop=_stop(body, max_stop_strings, max_stop_chars),
        ignore_eos=ignore_eos,
        logprobs=_logprobs(body, chat),
        constraint=constraint,
    )
    try:
        params.validate()
    except LLMRequestError as e:
        name = str(e).split(" ", 1)[0]
        raise ParamError(str(e), name if name in body else None) from None
    return params


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), checked before anything is sent: a wrong type found while streaming
    could only cut the stream."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ParamError(f"'stream' must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not isinstance(opts, dict):
        raise ParamError(f"'stream_options' must be an object, got {type(opts).__name__}", "stream_options")
    usage = opts.get("include_usage", False)
    if usage is not None and not isinstance(usage, bool):
        raise ParamError(
            f"'stream_options.include_usage' must be true or false, got {usage!r}", "stream_options"
        )
    return bool(stream), bool(usage)


# -- prompts ------------------------------------------------------------------------------------------
def _completion_prompts(prompt, max_context: int) -> list:
    """'prompt' as a list of prompts (each a string or a list of token ids)."""
    bad = ParamError(
        "'prompt' must be a non-empty string, a list of them, a list of token ids, or a list of those",
        "prompt",
    )
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        if len(prompt) >= max_context:  # before looking at each id
            raise ParamError(
                f"prompt has {len(prompt)} tokens; the model's context is {max_context}", "prompt"
            )
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise ParamError(
                f"'prompt' holds {len(prompt)} prompts; this server takes at most {MAX_PROMPTS}", "prompt"
            )
        prompts = prompt
    else:
        raise bad
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad
        elif not (isinstance(p, list) and p and all(type(t) is int for t in p[:max_context])):
            raise bad
    return prompts


@dataclass
class _Parsed:
    """A request checked, its prompts not yet tokenized: chat ``messages``, or ``prompts`` (text or ids)."""

    params: object
    n: int
    priority: int
    stream: bool
    include_usage: bool
    messages: list[dict] | None
    prompts: list | None
    tools: object = None  # tool_calls.ToolRequest
    constraint_key: str | None = None


def parse(svc, body: dict, chat: bool, header_priority, config) -> _Parsed:
    """Everything one request is checked for before its text is tokenized (a worker thread: off the event loop).
    LLMRequestError / ParamError name what is wrong."""
    from precast.runtime.server.llm_service import parse_priority
    from precast.runtime.server.tool_calls import check_tool_schemas, parse_tools

    refuse_unsupported(body, chat)
    n = _n(body)
    tools = parse_tools(body) if chat else None
    check_tool_schemas(tools, svc.engine.grammars)
    from precast.runtime.server.structured_params import constraint

    made, key = constraint(body, tools)
    params = sampling_params(body, config.max_stop_strings, config.max_stop_chars, chat, made)
    stream, include_usage = _stream_options(body)
    priority = parse_priority(body.get("priority", header_priority))
    if chat:
        try:
            messages = svc.clean_messages(
                body.get("messages"), config.max_text_chars, tools.tools if tools is not None else None
            )
        except ParamError:
            raise
        except LLMRequestError as e:  # (OpenAI names the parameter: messages)
            raise ParamError(str(e), "messages") from None
        return _Parsed(params, n, priority, stream, include_usage, messages, None, tools, key)
    prompts = _completion_prompts(body.get("prompt"), svc.max_context)
    if len(prompts) * n > MAX_CHOICES:
        raise ParamError(
            f"{len(prompts)} prompts x n={n} make {len(prompts) * n} completions; this server runs at most "
            f"{MAX_CHOICES} per request",
            "n",
        )
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > config.max_text_chars:  # tokenizing costs time and memory
        raise ParamError(
            f"'prompt' has {chars} characters; this server tokenizes at most {config.max_text_chars} "
            "per request (--max-text-chars)",
            "prompt",
        )
    return _Parsed(params, n, priority, stream, include_usage, None, prompts, None, key)


async def prepare(svc, body: dict, chat: bool, header_priority, config, timeout: float) -> Prepared:
    """A request checked and its prompts tokenized. The chat template and the tokenizer run in the service's
    TextSandbox within ``timeout`` s (the request's time left): no server thread waits on them."""
    from starlette.concurrency import run_in_threadpool

    parsed = await run_in_threadpool(parse, svc, body, chat, header_priority, config)
    if parsed.messages is not None:
        tools = parsed.tools.tools if parsed.tools is not None else None
        prompts = [await svc.chat_ids(parsed.messages, config.max_text_chars, timeout, tools)]
    else:
        prompts = parsed.prompts
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            encoded = iter(await svc.encode(texts, timeout))
            prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
    return await run_in_threadpool(_checked, svc, body, parsed, prompts)


def _checked(svc, body: dict, parsed: _Parsed, prompts: list[list[int]]) -> Prepared:
    """The prompts' ids checked against the model (vocabulary, context, KV pool), max_tokens fitted."""
    from precast.runtime.llm.prompt import prompt_ids

    engine = svc.engine
    ids = [
        prompt_ids(
            p,
            None,
            vocab=engine.vocab,
            max_context=engine.max_context,
            num_blocks=engine.pool.num_blocks,
            block_size=engine.block_size,
        )
        for p in prompts
    ]
    params = _fit_max_tokens(body, parsed.params, ids, engine)
    return Prepared(
        ids,
        params,
        parsed.n,
        parsed.priority,
        parsed.stream,
        parsed.include_usage,
        params.logprobs,
        parsed.tools,
        parsed.constraint_key,
    )


def _fit_max_tokens(body: dict, params, ids: list[list[int]], engine):
    """A max_tokens the context cannot hold beside the longest prompt: 400 naming the limit (as OpenAI);
    the default max_tokens is capped instead (the caller did not ask for it)."""
    context, pool = engine.max_context, engine.pool.num_blocks * engine.block_size
    limit = min(context, pool)
    longest = max(map(len, ids))
    if longest + params.max_tokens <= limit:
        return params
    key = _max_tokens_key(body)
    if key is None:
        return dataclasses.replace(params, max_tokens=max(1, limit - longest))
    where = (
        f"the model's context ({context})"
        if limit == context
        else f"the KV pool ({pool} tokens; serve with more --num-blocks or --kv-cache-memory)"
    )
    raise ParamError(f"{key} ({params.max_tokens}) + prompt tokens ({longest}) exceed {where}", key)
