"""The seams around the engine's step: the output processor (text, stop strings, logprobs, events), the
handle's public engine side, the scheduler's burst contract. No model: plain objects and the fake runner."""

from __future__ import annotations

import numpy as np

from precast.errors import LLMRequestError
from precast.runtime.llm import Engine, SamplingParams
from precast.runtime.llm.handle import RequestHandle, TokenEvent
from precast.runtime.llm.metrics import EngineCounters
from precast.runtime.llm.output_processor import (
    MAX_UNCOMMITTED,
    IncrementalDetokenizer,
    LogprobEvent,
    OutputProcessor,
)
from precast.runtime.llm.request import Request, Status, check_request_args
from precast.runtime.llm.scheduler import SchedulerOutput, StepKind
from tests.llm.engine.fake_runner import FakeRunner

EURO = "\u20ac".encode()  # 3 UTF-8 bytes: one token each below


class ByteTokenizer:
    """token id i <-> byte i (a character of several bytes spans several tokens, as byte-level BPE's do)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _request(prompt=(1, 2), **params) -> Request:
    req = Request("r", list(prompt), SamplingParams(**params))
    req.status = Status.RUNNING
    return req


def _processor(tokenizer=None):
    """A processor whose ``finish`` (the scheduler's, in an engine) records the reason."""
    finished = []

    def finish(req, why):
        finished.append(why)
        req.status, req.finish_reason = Status.FINISHED, why

    return OutputProcessor(tokenizer, EngineCounters(), finish), finished


def _add(proc, req, events):
    handle = RequestHandle(req, events.append, wait=lambda h: None)
    proc.add(handle)
    return handle


def test_detokenizer_holds_an_unfinished_character_back_then_commits_it():
    tok, detok, ids = ByteTokenizer(), IncrementalDetokenizer(), [65]  # prompt "A"
    shown = []
    for b in b"x" + EURO:
        ids.append(b)
        shown.append(detok.decode(tok, ids, 1))
    assert shown == ["x", "x\ufffd", "x\ufffd", "x\u20ac"]
    assert detok.committed == "x\u20ac"


def test_detokenizer_commits_a_never_finished_character_after_max_uncommitted_tokens():
    tok, detok, ids = ByteTokenizer(), IncrementalDetokenizer(), [65, 120]  # output "x"
    detok.decode(tok, ids, 1)
    for _ in range(MAX_UNCOMMITTED):
        ids.append(0xE2)  # starts a character no later byte finishes
        detok.decode(tok, ids, 1)
    assert detok.committed.startswith("x\ufffd")  # (not held forever: each step's window stays short)


def test_stop_string_cuts_the_text_finishes_and_holds_back_its_prefix():
    proc, finished = _processor(ByteTokenizer())
    req, events = _request(stop=("yz",), logprobs=1), []
    handle = _add(proc, req, events)
    logits = np.zeros((1, 256), np.float32)
    for b in b"xyz!":
        if req.finished:
            break
        req.token_ids.append(b)
        proc.emit(handle, req, b, logits, 0)
    assert finished == ["stop"]
    assert [e.text for e in events] == ["", "x", ""]  # 'y' held back (it may start "yz"), then cut
    assert handle.text == "x" and isinstance(events[0], LogprobEvent) and events[0].logprobs[1]
    assert req.request_id not in proc.handles and proc.recently_finished(req.request_id)


def test_plain_requests_and_their_bare_events():
    proc, _ = _processor(ByteTokenizer())
    assert proc.is_plain(_request(detokenize=False))
    assert not proc.is_plain(_request())  # text
    assert not proc.is_plain(_request(detokenize=False, logprobs=0))
    assert not proc.is_plain(_request(detokenize=False, temperature=0.5))
    assert _processor(None)[0].is_plain(_request())  # no tokenizer: no text
    req, events = _request(detokenize=False), []
    _add(proc, req, events)
    req.token_ids.append(9)
    assert proc.stream_plain([req], [9]) == 1
    assert events == [TokenEvent(9, "", 0, None)] and proc.counters.generation_tokens == 1


def test_a_raising_callback_fails_its_request_through_the_handles_public_side():
    proc, finished = _processor()
    req = _request(detokenize=False)
    handle = RequestHandle(req, lambda ev: 1 / 0, wait=lambda h: None)
    proc.add(handle)
    req.token_ids.append(5)
    proc.plain_token(handle, req, 5)
    assert finished == ["error"] and "ZeroDivisionError" in handle.error and handle.has_events
    assert proc.counters.requests_failed == 1 and not proc.handles


def test_unsampled_request_fails_with_a_last_event():
    proc, finished = _processor()
    req, events = _request(), []
    _add(proc, req, events)
    proc.fail_unsampled(req, LLMRequestError("NaN logits"))
    assert finished == ["error"] and events[-1].token_id == -1


def test_handle_waits_through_the_callback_it_was_given():
    waits = []
    req = _request()

    def wait(handle):
        waits.append(handle)
        req.status = Status.FINISHED

    handle = RequestHandle(req, wait=wait)
    assert list(handle) == [] and waits == [handle]


def test_engine_wires_processor_handles_and_wait():
    eng = Engine(FakeRunner(), None)
    h = eng.submit([1, 2, 3], SamplingParams(max_tokens=3))
    assert eng.output.handles == {h.request_id: h}
    eng.wait_for(h)  # no loop running: one step, whose token is h's first event
    assert h.has_events and len(h.result().token_ids) == 3


def test_request_args_are_checked_by_name():
    check_request_args(SamplingParams(), 0, None, None, has_tokenizer=False)
    for args, needle in (
        ((SamplingParams(), 0, 7, None), "request_id"),
        (({}, 0, None, None), "SamplingParams"),
        ((SamplingParams(), "hi", None, None), "priority"),
        ((SamplingParams(), 0, None, 3), "on_token"),
        ((SamplingParams(stop=("x",)), 0, None, None), "stop strings need a tokenizer"),
    ):
        try:
            check_request_args(*args, has_tokenizer=False)
        except LLMRequestError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"{args} passed")


def test_scheduler_allows_a_burst_only_for_a_one_row_steady_step():
    eng = Engine(FakeRunner(), None)
    eng.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=40, detokenize=False))
    out = None
    while out is None or out.kind is not StepKind.STEADY:
        out = eng.scheduler.schedule()
        logits = eng.runner.execute(out)
        eng.scheduler.update_from_output(out, [int(r.argmax()) for r in logits])
    assert eng.scheduler.burst_steps(out) == eng.scheduler.steady_steps_left() > 0
    two = SchedulerOutput(StepKind.STEADY)
    for req in (out.rows[0], out.rows[0]):
        two.add_row(req, 1, out.block_tables[0], [])
    assert eng.scheduler.burst_steps(two) == 0 and two.total_tokens == 2
    assert eng.scheduler.burst_steps(SchedulerOutput(StepKind.DECODE, out.rows, out.num_new)) == 0
