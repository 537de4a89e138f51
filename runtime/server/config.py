"""Server settings (what `precast serve` flags fill in), including the per-request limits.

The limits bound what one request may cost, so that no single client can stall or exhaust the server:

========================  ========  =======================================================================
field                     default   refused with
========================  ========  =======================================================================
max_request_bytes         8 MiB     413 before the body is read (Content-Length) or as soon as a streamed
                                    (chunked) body passes it
max_audio_bytes           25 MiB    400 naming the file: one uploaded audio file (/v1/audio/*, speech seq2seq
                                    artifacts); those routes' body limit is this + 1 MiB of form, not
                                    max_request_bytes
max_inflight_bytes        64 MiB    503 + Retry-After: request bodies held in memory at once, all requests
                                    together (default: 8 x max_request_bytes)
max_connections           1024      503 from uvicorn (its ``limit_concurrency``): open connections + tasks
max_embedding_inputs      128       400: texts in one /v1/embeddings request
max_embedding_tokens      8192      400: tokens one /v1/embeddings request runs (inputs x longest, padded)
max_text_chars            262144    400: characters one request hands the tokenizer (all embeddings inputs
                                    together, or a completion prompt / the chat messages); tokenizing
                                    costs ~50-100 bytes of memory per character while it runs
max_stop_strings          16        400: 'stop' strings in one completion request
max_stop_chars            256       400: characters in one 'stop' string
header_timeout            10 s      connection closed: request line + headers not complete by then
text_timeout              2 s       504: the artifact's chat template + tokenizer on one request ran longer
                                    (per 64 Ki characters of the request's text: long prompts take longer)
text_memory               128 MiB   400: ... needed more memory than this (each call is its own process)
text_workers              64        such calls at once; more wait in order within their request's deadline
========================  ========  =======================================================================

HTTP headers are bounded by h11 (16 KiB), JSON nesting by the parser (about 1000 levels).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from precast.options import opt
from precast.runtime.llm.speculative_options import SPECULATIVE_OPTIONS, SpeculativeOptions
from precast.runtime.server.kv_memory import parse_size

if TYPE_CHECKING:
    from precast.artifact.signing import SignaturePolicy

__all__ = [
    "ADMIN_TOKEN_ENV",
    "API_KEY_ENV",
    "LLM_OPTIONS",
    "SCHEDULER_OPTIONS",
    "KVPoolOptions",
    "ServerConfig",
    "is_loopback",
]

ADMIN_TOKEN_ENV = "PRECAST_ADMIN_TOKEN"
API_KEY_ENV = "PRECAST_API_KEY"
MiB = 1 << 20


@dataclass(frozen=True)
class KVPoolOptions:
    """How big the LLM engine's KV pool is: `precast serve` flags that go to the engine (ServerConfig.llm),
    read by llm_service. Unset (None): the artifact's default."""

    num_blocks: int | None = opt(None, "KV cache blocks in the pool.", min=1)
    kv_cache_memory: int | None = opt(
        None,
        "KV cache size instead of --num-blocks, e.g. 512MiB, 2GiB, 1.5GB (converted to whole blocks).",
        parse=parse_size,
        metavar="size",
    )


# The scheduler's options `precast serve` hands the LLM engine (runtime.llm.scheduler.SchedulerConfig fields).
SCHEDULER_OPTIONS = ("max_num_seqs", "max_num_batched_tokens")
# `precast serve` flags that go to the LLM engine (ServerConfig.llm) rather than to the server itself.
LLM_OPTIONS = tuple(f.name for f in fields(KVPoolOptions)) + SCHEDULER_OPTIONS + SPECULATIVE_OPTIONS

# Fields that must be positive integers (checked in __post_init__, so a library caller gets one line too).
_COUNTS = (
    "max_request_bytes",
    "max_audio_bytes",
    "max_inflight_bytes",
    "max_connections",
    "max_embedding_inputs",
    "max_embedding_tokens",
    "max_text_chars",
    "max_stop_strings",
    "max_stop_chars",
)


@dataclass
class ServerConfig:
    """What `precast serve` runs with. A field with a help is a flag of the command (cli/commands_serve.py
    generates them from these fields, precast/options.py), so its default, bound and help live here only."""

    artifact: Path
    host: str = opt("127.0.0.1", "Address to bind.")
    port: int = opt(8000, "Port to bind.", min=0, max=65535)
    model_name: str | None = opt(None, "Name in the API (default: the artifact folder's name).")
    max_batch_size: int = opt(8, "Dynamic batching: most rows per model call (1 turns batching off).", min=1)
    max_queue_delay_ms: float = opt(2.0, "Dynamic batching: how long the oldest request waits for others.")
    max_queue: int = opt(256, "Queued requests before answering 429.", min=1)
    request_timeout: float = opt(60.0, "Per-request timeout in seconds (504 after it).", min=0.001)
    admin_token: str | None = opt(
        None,
        "Token for /admin/* (required beyond loopback, and for requests through a proxy; not empty).",
        env=ADMIN_TOKEN_ENV,
    )
    api_key: str | None = opt(
        None,
        "Key the inference endpoints (/v1/*, /v2/models/*/infer) require as 'Authorization: Bearer <key>' "
        "(not empty; /health, /ready, /metrics stay open).",
        env=API_KEY_ENV,
    )
    threads: int | None = None  # ORT intra-op threads per session (--threads: cli/output.py THREADS)
    instances: int = opt(1, "Model calls that may run at once.", min=1)
    drain_timeout: float = opt(30.0, "On SIGTERM/SIGINT: seconds to finish in-flight requests.")
    verify: bool = True  # re-run stored parity feeds on load and reload
    # A packed artifact's signed statement, checked at start and on every reload (artifact/signing.py):
    pubkey: Path | None = None  # Ed25519 public key (PEM); None: no signature required
    expect_name: str | None = None  # the signed name must be this
    min_version: str | None = None  # the signed version must be at least this
    log_level: Literal["critical", "error", "warning", "info", "debug"] = opt("info")
    llm: dict = field(default_factory=dict)  # options handed to the LLM engine (num_blocks, max_tokens, ...)
    # Per-request limits (see the table above).
    max_request_bytes: int = opt(
        8 * MiB, "Largest request body accepted (413 beyond it, before the body is read).", min=1
    )
    max_audio_bytes: int = opt(
        25 * MiB,
        "Largest audio file one /v1/audio/* request uploads (speech seq2seq artifacts; OpenAI's limit).",
        min=1,
    )
    max_inflight_bytes: int | None = None  # default: 8 x max_request_bytes
    max_connections: int = opt(1024, "Open connections and requests at once (503 beyond them).", min=1)
    max_embedding_inputs: int = opt(128, "Most texts in one /v1/embeddings request.", min=1)
    max_embedding_tokens: int = opt(
        8192, "Most tokens one /v1/embeddings request runs (texts x longest text).", min=1
    )
    max_text_chars: int = opt(
        256 * 1024, "Most characters one request hands the tokenizer (embeddings inputs, or a prompt).", min=1
    )
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    header_timeout: float = 10.0  # seconds a request may take to send its request line and headers
    # The artifact's chat template and tokenizer, per request (text_sandbox.py: a process per call).
    text_timeout: float = opt(
        2.0,
        "Seconds the artifact's chat template and tokenizer may run on one request (504 past it).",
        min=0.001,
    )
    text_memory: int = opt(
        128 * MiB,
        "Memory the chat template and tokenizer may use on one request, e.g. 128MiB (400 past it).",
        parse=parse_size,
        metavar="size",
    )
    text_workers: int = opt(
        64, "Requests whose text is rendered and tokenized at once (each in its own process).", min=1
    )

    def __post_init__(self) -> None:
        from precast.errors import UsageError

        self.artifact = Path(self.artifact)
        self.admin_token = _secret(
            "admin_token", self.admin_token, ADMIN_TOKEN_ENV, "token", "to keep admin endpoints loopback-only"
        )
        self.api_key = _secret("api_key", self.api_key, API_KEY_ENV, "key", "for open endpoints")
        self._check_signature_options()
        if self.max_inflight_bytes is None and isinstance(self.max_request_bytes, int):
            self.max_inflight_bytes = 8 * self.max_request_bytes
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.header_timeout, bool)
            or not isinstance(self.header_timeout, (int, float))
            or not (self.header_timeout > 0)
        ):
            raise UsageError(
                f"header_timeout must be a positive number of seconds, got {self.header_timeout!r}"
            )
        self.text_limits  # noqa: B018  (checks the three text_* fields: one line naming a bad one)
        if self.max_inflight_bytes < self.max_request_bytes:
            raise UsageError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                f"max_request_bytes ({self.max_request_bytes})"
            )

    def _check_signature_options(self) -> None:
        from precast.errors import UsageError

        if self.pubkey is not None:
            self.pubkey = Path(self.pubkey)
            if self.artifact.is_dir():
                raise UsageError(
                    f"--pubkey checks packed artifacts; {self.artifact} is a directory, which carries no "
                    "signature: serve the file `precast pack --sign-key` wrote"
                )
        _ = self.signature_policy  # --expect-name / --min-version: well-formed, and only with a key

    @property
    def signature_policy(self) -> SignaturePolicy | None:
        """The SignaturePolicy a served pack must meet at start and on every reload (None: unsigned is fine)."""
        from precast.artifact.signing import signature_policy

        return signature_policy(self.pubkey, self.expect_name, self.min_version)

    @classmethod
    def from_options(cls, artifact, **options) -> ServerConfig:
        """From `precast serve`'s flags: the artifact path is checked first, the LLM engine's options
        (LLM_OPTIONS; None = unset) go to ``llm``, everything else is a field."""
        from precast.errors import UsageError
        from precast.runtime.server.host import check_path

        check_path(artifact)
        llm = {k: v for k in LLM_OPTIONS if (v := options.pop(k, None)) is not None}
        if "num_blocks" in llm and "kv_cache_memory" in llm:
            raise UsageError("--kv-cache-memory and --num-blocks both size the KV pool: give one of them")
        # (a bad combination, or a draft that is not there, fails before the target loads)
        SpeculativeOptions(**{k: llm[k] for k in SPECULATIVE_OPTIONS if k in llm}).config()
        return cls(artifact, llm=llm, **options)

    @property
    def text_limits(self):
        from precast.runtime.server.text_sandbox import TextLimits

        return TextLimits(self.text_timeout, self.text_memory, self.text_workers)

    @property
    def name(self) -> str:
        return self.model_name or self.artifact.name.removesuffix(".tar") or "model"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _secret(name: str, value: object, env: str, what: str, instead: str) -> str | None:
    """A bearer secret (--admin-token, --api-key): None takes ``env`` (empty there = unset); an empty one
    is refused, since it would match an empty Authorization header and let anyone in."""
    from precast.errors import UsageError

    if value is None:
        return os.environ.get(env) or None
    if not isinstance(value, str):
        raise UsageError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        flag = "--" + name.replace("_", "-")
        raise UsageError(f"{flag} must not be empty (an empty {what} would let anyone in); omit it {instead}")
    return value
