"""An LLM engine over the fake runner with a byte tokenizer: text prompts in milliseconds, no torch, no artifact."""

from __future__ import annotations

from precast.runtime.llm import Engine
from tests.llm.engine.fake_runner import FakeRunner, FakeSpec

__all__ = ["ByteTokenizer", "fake_engine"]


class ByteTokenizer:
    """UTF-8 bytes -> ids 1..63 (the fake runner's vocab is 64); ids decode to letters."""

    def encode(self, text):
        return [1 + b % 63 for b in text.encode()]

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def fake_engine(max_context: int = 32, num_blocks: int = 64) -> Engine:
    return Engine(FakeRunner(FakeSpec(max_context=max_context), num_blocks), ByteTokenizer())
