"""An LLM engine over the fake runner with a byte tokenizer: text prompts in milliseconds, no torch, no artifact."""

from __future__ import annotations

from precast.runtime.llm import Engine
from tests.llm.engine.fake_runner import FakeRunner, FakeSpec

__all__ = ["ByteTokenizer", "InProcessText", "fake_engine"]


class ByteTokenizer:
    """UTF-8 bytes -> ids 1..63 (the fake runner's vocab is 64); ids decode to letters."""

    def encode(self, text):
        return [1 + b % 63 for b in text.encode()]

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def fake_engine(max_context: int = 32, num_blocks: int = 64) -> Engine:
    return Engine(FakeRunner(FakeSpec(max_context=max_context), num_blocks), ByteTokenizer())


class InProcessText:
    """TextSandbox's interface over a Python tokenizer, in this process (the fake engine has no tokenizer file).
    Chat prompts render as the default ChatML."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.running = 0

    def _run(self, op, args):
        from precast.errors import LLMRequestError

        if op == "encode":
            return [self.tokenizer.encode(t) for t in args["texts"]]
        from precast.runtime.server.text_worker import _ChatML

        text = _ChatML().render(args["messages"])
        limit = args.get("max_chars")
        if limit is not None and len(text) > limit:
            raise LLMRequestError(f"the rendered chat prompt has {len(text)} characters (--max-text-chars)")
        return {"text": text} if args.get("encode") is False else {"ids": self.tokenizer.encode(text)}

    def call(self, op, args, timeout=None, chars=0):
        from concurrent.futures import Future

        fut = Future()
        try:
            fut.set_result(self._run(op, args))
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    async def acall(self, op, args, timeout=None, chars=0):
        return self._run(op, args)

    def close(self):
        pass
