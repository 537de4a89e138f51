"""One generation request's state, as the scheduler and the engine see it (plain data)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from precast.errors import LLMRequestError
from precast.runtime.llm.sampler import SamplingParams, is_int

if TYPE_CHECKING:
    from precast.runtime.llm.output_processor import IncrementalDetokenizer

__all__ = ["Request", "Status", "check_request_args"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower = more urgent
    seq: int = 0  # arrival order (FCFS tie-break)
    arrival_step: int = 0  # scheduler step at arrival (aging)
    max_total_tokens: int = 0  # context / pool cap: prompt + output never exceeds it
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits on first admission
    t_scheduled: float | None = None  # perf_counter() at first admission (its queue time ends there)
    rng: np.random.Generator | None = None
    # The output processor's incremental detokenization of this request (made at its first text token)
    detokenizer: IncrementalDetokenizer | None = None
    argmax: bool = False  # greedy with no penalty: the next token is the logits' argmax (set from params)
    # Set by Scheduler.add: the token ids that stop it (EOS unless ignored, stop_token_ids), and the length
    # (prompt + output) at which it ends: max_tokens or the context cap
    stop_ids: frozenset = frozenset()
    end_len: int = 0
    # Its structured-output matcher (llguidance, fed each output token), when params.constraint is set
    matcher: object = None
    # Speculative decoding (runtime/llm/speculative.py): its adaptive state (None: it never speculates), and
    # how many unverified draft tokens end token_ids during a step (0 outside the engine's step)
    spec: object = None
    num_draft: int = 0

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.rng is None:
            self.rng = np.random.default_rng(self.params.seed)
        self.argmax = self.params.greedy and self.params.plain and self.params.constraint is None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the cache (prompt chunks, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def check_request_args(params, priority, request_id, on_token, *, has_tokenizer: bool) -> None:
    """LLMRequestError naming the first bad argument of a request (all but its prompt, which
    prompt.prompt_ids checks). Pure checks: the engine makes them before it takes its lock."""
    if request_id is not None and not isinstance(request_id, str):
        raise LLMRequestError(f"request_id must be a string, got {type(request_id).__name__}")
    if not isinstance(params, SamplingParams):
        raise LLMRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if not is_int(priority):
        raise LLMRequestError(f"priority must be an integer (lower = more urgent), got {priority!r}")
    if on_token is not None and not callable(on_token):
        raise LLMRequestError(f"on_token must be callable, got {type(on_token).__name__}")
    if params.stop and not has_tokenizer:
        raise LLMRequestError("stop strings need a tokenizer")
