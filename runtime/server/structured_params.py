"""The structured-output parameters of an OpenAI request -> one ``structured.Constraint`` (or a 400 naming the key).

Sources: ``response_format`` (json_object, json_schema), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and a forced tool call (``tool_choice`` required or named: tool_calls.py
gives its schema). At most one per request.
"""

from __future__ import annotations

import re

from precast.errors import LLMRequestError
from precast.runtime.server.openai_params import ParamError

__all__ = ["constraint"]


# -- structured outputs ------------------------------------------------------------------------------
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _response_format(v):
    """response_format -> a Constraint, or None (text)."""
    from precast.runtime.llm.structured import Constraint

    key = "response_format"
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise ParamError(f"'{key}' must be an object with a 'type', got {v!r}", key)
    kind = v["type"]
    extra = set(v) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if kind not in ("text", "json_object", "json_schema"):
        raise ParamError(f"'{key}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", key)
    if extra:
        raise ParamError(f"'{key}' of type {kind!r} has unknown keys {sorted(extra)}", key)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise ParamError(f"'{key}.json_schema' must be an object with a 'name' and a 'schema'", key)
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ParamError(f"'{key}.json_schema' has unknown keys {sorted(unknown)}", key)
    name = js.get("name")
    if not isinstance(name, str) or not re.match(r"^[a-zA-Z0-9_-]{1,64}$", name):
        raise ParamError(f"'{key}.json_schema.name' must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", key)
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ParamError(f"'{key}.json_schema.strict' must be true or false, got {js['strict']!r}", key)
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise ParamError(f"'{key}.json_schema.description' must be a string", key)
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise ParamError(f"'{key}.json_schema.schema' must be a JSON schema (an object), got {schema!r}", key)
    return Constraint.json_schema(schema)


def _guided(key: str, v):
    from precast.runtime.llm.structured import Constraint

    make = {
        "guided_json": Constraint.json_schema,
        "guided_regex": Constraint.regex,
        "guided_choice": Constraint.choice,
        "guided_grammar": Constraint.grammar,
    }[key]
    return make(v)


def constraint(body: dict, tools=None):
    """(Constraint or None, the body key it came from): at most one source per request."""
    from precast.runtime.llm.structured import Constraint

    made = {}
    key = "response_format"
    try:
        if body.get(key) is not None:
            made[key] = _response_format(body[key])  # None: text
        for key in _GUIDED:
            if body.get(key) is not None:
                made[key] = _guided(key, body[key])
        key = "tools"
        schema = tools.schema() if tools is not None else None
        if schema is not None:
            made[key] = Constraint.json_schema(schema)
    except ParamError:
        raise
    except LLMRequestError as e:
        raise ParamError(f"'{key}': {e}", key) from None
    sources = [k for k, c in made.items() if c is not None]
    if len(sources) > 1:
        named = ["tool_choice" if k == "tools" else k for k in sources]
        raise ParamError(
            f"{' and '.join(repr(k) for k in named)} both constrain the output: give one of them", named[1]
        )
    return (made[sources[0]], sources[0]) if sources else (None, None)
