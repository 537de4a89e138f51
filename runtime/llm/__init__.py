"""LLM runtime: paged KV cache, continuous batching scheduler, sampler, engine (numpy + the artifact's backend)."""

from precast.runtime.llm.engine import Engine
from precast.runtime.llm.handle import Completion, RequestHandle, TokenEvent
from precast.runtime.llm.metrics import EngineMetrics
from precast.runtime.llm.runners.gather import LLMSpec, ModelRunner
from precast.runtime.llm.sampler import SamplingParams
from precast.runtime.llm.scheduler import SchedulerConfig

__all__ = [
    "Engine",
    "SamplingParams",
    "SchedulerConfig",
    "RequestHandle",
    "TokenEvent",
    "Completion",
    "EngineMetrics",
    "ModelRunner",
    "LLMSpec",
]
