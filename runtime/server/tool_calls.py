"""OpenAI tool calling: a request's ``tools`` / ``tool_choice`` checked, the constraint that forces a call, and a
choice's output text -> ``tool_calls``.

    tool_choice                     constraint (the engine's)                    the output, parsed as
    "none"                          none                                         content (no parsing)
    "auto" (default with tools)     none                                         Hermes ``<tool_call>{"name", "arguments"}
                                                                                 </tool_call>`` blocks, or a bare JSON call
                                                                                 (or list of calls) naming a known tool;
                                                                                 else content
    "required"                      JSON schema: an array (maxItems 1 unless     the array's calls
                                    parallel_tool_calls) of anyOf
                                    {"name": const, "parameters": its schema}
    {"type": "function",            that function's parameters schema            that function's arguments
     "function": {"name": f}}

The tools reach the model through its chat template's ``tools`` variable (as transformers renders them); with
tool_choice "none" the template still lists them (OpenAI's behaviour: the model knows them, calls none).
A forced call whose output does not parse (it ran out of max_tokens) is returned as content, with its
finish_reason ("length"), never as a broken call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from precast.runtime.server.openai_params import ParamError

__all__ = ["MAX_TOOLS", "ToolCall", "ToolRequest", "check_tool_schemas", "parse_tools"]

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def wire(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolRequest:
    """The tools of a chat request, checked: ``tools`` as the template sees them (OpenAI's dicts)."""

    tools: list
    choice: str  # "auto" | "none" | "required" | "function"
    name: str | None  # tool_choice's function
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _parameters(self, name: str) -> dict:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)

    def schema(self) -> dict | None:
        """The JSON schema the output must match (a forced call), or None (free output)."""
        if self.choice == "function":
            return self._parameters(self.name)
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": self._parameters(n)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n in self.names
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content before the calls, the calls) that ``text`` makes, or None: it is plain content."""
        if self.choice == "none":
            return None
        if self.choice == "function":
            args = _loads(text)
            return (None, [ToolCall(self.name, _dumps(args))]) if isinstance(args, dict) else None
        if self.choice == "required":
            calls = _calls(_loads(text), set(self.names), keys=("parameters",))
            return (None, calls) if calls else None
        found = self._auto(text)
        if found is None:
            return None
        content, calls = found
        return content, calls if self.parallel else calls[:1]

    def _auto(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        known = set(self.names)
        if "<tool_call>" in text:
            blocks = _HERMES.findall(text)
            calls = [_calls(_loads(b), known) for b in blocks]
            if not blocks or not all(calls):
                return None
            content = text[: text.index("<tool_call>")].strip()
            return content or None, [c for cs in calls for c in cs]
        body = text.strip()
        if body.startswith("[TOOL_CALLS]"):  # Mistral's prefix
            body = body[len("[TOOL_CALLS]") :].strip()
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return None
        calls = _calls(_loads(body), known)
        return (None, calls) if calls else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _calls(obj, known: set[str], keys=("arguments", "parameters")) -> list[ToolCall]:
    """``obj`` (a call or a list of calls: ``{"name", "arguments" | "parameters"}``) as ToolCalls; [] if any is not
    a call of a known tool."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return []
        args = next((item[k] for k in keys if k in item), None)
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = _loads(args)
        if not isinstance(args, dict) or set(item) - {"name", *keys}:
            return []
        out.append(ToolCall(item["name"], _dumps(args)))
    return out


# -- the request's tools ------------------------------------------------------------------------------------
def _tool(i: int, t) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise ParamError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", "tools")
    if set(t) - {"type", "function"}:
        raise ParamError(f"'{where}' has unknown keys {sorted(set(t) - {'type', 'function'})}", "tools")
    f = t["function"]
    extra = set(f) - _FUNCTION_KEYS
    if extra:
        raise ParamError(f"'{where}.function' has unknown keys {sorted(extra)}", "tools")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ParamError(f"'{where}.function.name' must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", "tools")
    desc = f.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ParamError(f"'{where}.function.description' must be a string", "tools")
    params = f.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ParamError(f"'{where}.function.parameters' must be a JSON schema of type 'object'", "tools")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ParamError(f"'{where}.function.strict' must be true or false", "tools")
    out = {"name": name, **({"description": desc} if desc is not None else {}), "parameters": params}
    return {"type": "function", "function": out}


def _choice(v, names: list[str]) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if names else "none"), None
    if v in ("none", "auto", "required"):
        if v == "required" and not names:
            raise ParamError("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if not names:
            raise ParamError("'tool_choice' names a function but there are no 'tools'", "tool_choice")
        if name not in names:
            raise ParamError(
                f"'tool_choice' names function {name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        return "function", name
    raise ParamError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {v!r}",
        "tool_choice",
    )


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools checked (a ParamError naming the fault), or None: no tools, nothing to parse."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ParamError(f"'tools' must be a list, got {type(raw).__name__}", "tools")
    if len(raw) > MAX_TOOLS:
        raise ParamError(f"'tools' has {len(raw)} tools; at most {MAX_TOOLS}", "tools")
    tools = [_tool(i, t) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ParamError(f"'tools' names function(s) {', '.join(dup)} more than once", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError(
            f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls"
        )
    choice, name = _choice(body.get("tool_choice"), names)
    if not tools:
        for key in ("tool_choice", "parallel_tool_calls"):  # (OpenAI's: only with tools)
            if body.get(key) is not None and body.get(key) != "none":
                raise ParamError(f"'{key}' is only allowed when 'tools' are given", key)
        return None
    return ToolRequest(tools, choice, name, parallel is not False)


def check_tool_schemas(tools: ToolRequest | None, grammars) -> None:
    """Each tool's parameters compiled as a JSON schema by the engine's grammar engine (cached per schema),
    whatever the tool_choice: a tool the model is shown must be callable. A 400 naming the tool."""
    from precast.errors import LLMRequestError
    from precast.runtime.llm.structured import Constraint, structured_available

    if tools is None or not structured_available():
        return
    for i, t in enumerate(tools.tools):
        try:
            grammars.matcher(Constraint.json_schema(t["function"]["parameters"]))
        except LLMRequestError as e:
            raise ParamError(f"'tools[{i}].function.parameters': {e}", "tools") from None
