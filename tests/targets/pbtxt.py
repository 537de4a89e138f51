"""A small protobuf text-format reader for tests: enough of the grammar for Triton's config.pbtxt.

``parse(text)`` returns a message as ``{field: [values]}`` (every field a list, since fields repeat);
a value is a str, int, float, bool, enum name (str) or a nested message (dict). Independent of the
writer in targets/triton_config.py, so a test reading a config with it checks the text, not the writer.
"""

from __future__ import annotations

import re

__all__ = ["one", "parse"]

_TOKEN = re.compile(
    r'\s*(?:(#[^\n]*)|("(?:[^"\\]|\\.)*")|([{}\[\]:,;<>])|([A-Za-z_][\w.]*)|(-?[\d.]+(?:[eE][-+]?\d+)?))'
)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"pbtxt: cannot read at {text[pos : pos + 30]!r}")
        pos = m.end()
        if m.group(1) is None:
            out.append(m.group(0).strip())
    return out


def _scalar(tok: str):
    if tok.startswith('"'):
        return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
    if tok in ("true", "false"):
        return tok == "true"
    if re.fullmatch(r"-?\d+", tok):
        return int(tok)
    try:
        return float(tok)
    except ValueError:
        return tok  # an enum name such as TYPE_FP32


class _Reader:
    def __init__(self, tokens: list[str]):
        self.t, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"pbtxt: expected {want or 'a token'} at token {self.i}, got {tok!r}")
        self.i += 1
        return tok

    def message(self, end: str | None) -> dict:
        msg: dict[str, list] = {}
        while self.peek() != end:
            key = self.take()
            if not re.fullmatch(r"[A-Za-z_][\w.]*", key):
                raise ValueError(f"pbtxt: expected a field name, got {key!r}")
            if self.peek() == ":":
                self.take(":")
            msg.setdefault(key, []).extend(self.values())
            if self.peek() in (",", ";"):
                self.take()
        return msg

    def values(self) -> list:
        if self.peek() == "[":
            self.take("[")
            out = []
            while self.peek() != "]":
                out.extend(self.values())
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return out
        if self.peek() in ("{", "<"):
            close = "}" if self.take() == "{" else ">"
            msg = self.message(close)
            self.take(close)
            return [msg]
        return [_scalar(self.take())]


def parse(text: str) -> dict:
    reader = _Reader(_tokens(text))
    msg = reader.message(None)
    return msg


def one(msg: dict, key: str, default=None):
    """The single value of a non-repeated field."""
    values = msg.get(key)
    if not values:
        return default
    assert len(values) == 1, f"field '{key}' repeats: {values}"
    return values[0]
