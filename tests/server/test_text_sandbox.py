"""TextSandbox alone (no model): what a chat template and a tokenizer can do in it, and what stops them."""

from __future__ import annotations

import time

import pytest

from precast.errors import LLMRequestError
from precast.runtime.server.text_sandbox import (
    TextFailed,
    TextLimits,
    TextSandbox,
    TextTimeout,
)

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hi": 1, "there": 2, "be": 3, "brief": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _sandbox(template, tokenizer_file, **limits):
    return TextSandbox(template=template, tokenizer=tokenizer_file, limits=TextLimits(**limits)).start()


def test_templates_render_as_transformers_renders_them(tokenizer_file):
    """loop controls, raise_exception and strftime_now are there (transformers' chat template environment)."""
    tmpl = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{{ m['content'] }}{% break %}{% endfor %}|{{ strftime_now('%Y') }}"
        "{% if messages|length > 5 %}{{ raise_exception('too many') }}{% endif %}"
    )
    box = _sandbox(tmpl, tokenizer_file)
    try:
        out = box.call("chat", {"messages": MSGS, "encode": False}).result(30)
        assert out["text"] == f"hi there|{time.strftime('%Y')}"
        assert box.call("chat", {"messages": MSGS}).result(30)["ids"][:2] == [1, 2]
        with pytest.raises(LLMRequestError, match="too many"):
            box.call("chat", {"messages": MSGS * 3}).result(30)
    finally:
        box.close()


def test_the_default_template_is_chatml(tokenizer_file):
    from precast.runtime.server.llm_service import DEFAULT_CHAT_TEMPLATE

    jinja = _sandbox(DEFAULT_CHAT_TEMPLATE, tokenizer_file)
    plain = _sandbox(None, tokenizer_file)  # the worker's own ChatML (no jinja2 needed)
    try:
        args = {"messages": MSGS, "encode": False}
        assert jinja.call("chat", args).result(30) == plain.call("chat", args).result(30)
    finally:
        jinja.close()
        plain.close()


def test_a_call_is_stopped_at_its_deadline_and_its_memory(tokenizer_file):
    spin = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    box = _sandbox(spin, tokenizer_file, timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TextTimeout, match="--text-timeout"):
            box.call("chat", {"messages": MSGS}).result(60)
        assert time.monotonic() - t0 < 30  # (0.5 s, far from the 10^10 iterations it asked for)
        assert box.running == 0
        assert box.call("encode", {"texts": ["hi", "there"]}).result(30) == [[1], [2]]
    finally:
        box.close()
    grow = "{% set ns = namespace(s='0123456789') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    box = _sandbox(grow, tokenizer_file, memory=32 << 20)
    try:
        with pytest.raises(TextFailed, match="--text-memory 32 MiB"):
            box.call("chat", {"messages": MSGS}).result(60)
    finally:
        box.close()


def test_a_cancelled_call_stops_its_child_and_close_fails_the_rest(tokenizer_file):
    spin = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    box = _sandbox(spin, tokenizer_file, timeout=60)
    try:
        fut = box.call("chat", {"messages": MSGS})
        box.cancel(fut)
        with pytest.raises(TextFailed, match="cancelled"):
            fut.result(30)
        pending = box.call("chat", {"messages": MSGS})
    finally:
        box.close()
    with pytest.raises(Exception, match="shutting down"):
        pending.result(30)


def test_a_template_that_does_not_compile_is_an_artifact_error(tokenizer_file):
    from precast.errors import ArtifactError

    with pytest.raises(ArtifactError, match="does not compile"):
        _sandbox("{% for %}", tokenizer_file)
