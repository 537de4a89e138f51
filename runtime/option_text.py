"""An option's text parsed by a regular expression, or a UsageError that shows the text and what was expected.

Shared by the compiler's ``--input NAME:DTYPE[dims]`` and the runtime's accuracy budgets, so that every option
written in a small syntax of its own fails with the same kind of message (and the runtime needs nothing from
the compiler for it).
"""

from __future__ import annotations

import re

from precast.errors import UsageError

__all__ = ["option_groups"]


def option_groups(pattern: re.Pattern[str], text: str, what: str, expected: str) -> tuple[str, ...]:
    """The groups of ``pattern`` matched at the start of ``text``; else UsageError
    ``bad <what> '<text>': expected <expected>``."""
    m = pattern.match(text)
    if m is None:
        raise UsageError(f"bad {what} '{text}': expected {expected}")
    return m.groups()
