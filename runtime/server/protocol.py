"""The OpenAI-style wire format: request models (pydantic) and the response bodies precast sends.

A request body is checked in two layers: its fields' types here (a pydantic model: a wrong type is a 400
naming the field, ``'encoding_format': ...``), then what the values mean where they are used (a prompt
that does not fit, a ``dimensions`` that is not the model's size: embeddings.py, openai_params.py). Fields
that precast does not know are kept (``extra="allow"``): openai_params.py refuses the unsupported ones by
name and ignores informational ones, as OpenAI's own server does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from precast.errors import InputError, PrecastError

__all__ = [
    "EmbeddingRequest",
    "OpenAIRequest",
    "chat_choice",
    "chunk_choice",
    "completion_choice",
    "embedding_response",
    "model_list",
    "parse_request",
    "tool_call_deltas",
    "usage",
]


class OpenAIRequest(BaseModel):
    """What every /v1 request body has: the model it names (None: this server's)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None


class EmbeddingRequest(OpenAIRequest):
    input: object = None  # a string or a list of strings: embeddings.parse_inputs names the culprit
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


def parse_request(cls: type[OpenAIRequest], body: object, error_cls: type[PrecastError] = InputError):
    """``body`` as ``cls``; a type error is ``error_cls`` with one line naming the field (and ``param``)."""
    if not isinstance(body, dict):
        raise error_cls("request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        e2 = error_cls(f"'{field}': {err['msg'][0].lower()}{err['msg'][1:]}, got {err['input']!r}")
        e2.param = field
        raise e2 from None


# -- responses ----------------------------------------------------------------------------------------
def model_list(name: str, created: float) -> dict:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": int(created), "owned_by": "precast"}],
    }


def embedding_response(name: str, embeddings: list, n_tokens: int) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
    return {
        "object": "list",
        "data": data,
        "model": name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_choice(
    index: int, text: str | None, finish: str | None, logprobs: dict | None, tool_calls: list | None = None
) -> dict:
    """``tool_calls``: ToolCall.wire() dicts (then ``text`` is what came before them, or None)."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def tool_call_deltas(tool_calls: list) -> list[dict]:
    """OpenAI's streamed shape of ToolCall.wire() dicts: per call a delta naming it (empty arguments), then one
    with its arguments text (a client concatenates ``arguments`` per ``index``)."""
    out = []
    for i, c in enumerate(tool_calls):
        head = {**c, "function": {"name": c["function"]["name"], "arguments": ""}}
        out.append({"tool_calls": [{"index": i, **head}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


def chunk_choice(index: int, delta, finish: str | None, logprobs: dict | None, chat: bool) -> dict:
    """One streamed choice: chat's ``delta`` (empty on the final chunk unless it carries text) or text."""
    if chat:
        return {
            "index": index,
            "delta": delta if finish is None or delta.get("content") else {},
            "finish_reason": finish,
            "logprobs": logprobs,
        }
    return completion_choice(index, delta, finish, logprobs)
