"""option_text.option_groups: the one way an option in a small syntax of its own is parsed (--input, budgets)."""

from __future__ import annotations

import re

import pytest

from precast.errors import UsageError
from precast.runtime.option_text import option_groups

_PAIR = re.compile(r"^\s*(\w+)=(\d+)\s*$")


def test_option_groups_returns_the_groups():
    assert option_groups(_PAIR, " batch=8 ", "--dim", "NAME=SIZE") == ("batch", "8")


def test_option_groups_names_the_option_the_text_and_the_syntax():
    with pytest.raises(UsageError, match=r"^bad --dim 'batch': expected NAME=SIZE$"):
        option_groups(_PAIR, "batch", "--dim", "NAME=SIZE")


def test_input_spec_and_budget_share_it():
    from precast.compiler.frontends.source import parse_input_spec
    from precast.runtime.accuracy import parse_budget

    with pytest.raises(UsageError, match=r"bad --input 'x': expected NAME:DTYPE\[dim"):
        parse_input_spec("x")
    with pytest.raises(UsageError, match=r"bad accuracy budget item 'cosine': expected METRIC>=VALUE"):
        parse_budget(" cosine ")
