"""Server settings (what `precast serve` flags fill in), including the per-request limits.

The limits bound what one request may cost, so that no single client can stall or exhaust the server:

========================  ========  =======================================================================
field                     default   refused with
========================  ========  =======================================================================
max_request_bytes         8 MiB     413 before the body is read (Content-Length) or as soon as a streamed
                                    (chunked) body passes it
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from precast.runtime.signing import SignaturePolicy

__all__ = ["ADMIN_TOKEN_ENV", "API_KEY_ENV", "LLM_OPTIONS", "ServerConfig", "is_loopback"]

ADMIN_TOKEN_ENV = "PRECAST_ADMIN_TOKEN"
API_KEY_ENV = "PRECAST_API_KEY"
MiB = 1 << 20

# `precast serve` flags that go to the LLM engine (ServerConfig.llm) rather than to the server itself.
LLM_OPTIONS = ("num_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens")

# Fields that must be positive integers (checked in __post_init__, so a library caller gets one line too).
_COUNTS = (
    "max_request_bytes",
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
    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # default: the artifact folder's name
    max_batch_size: int = 8
    max_queue_delay_ms: float = 2.0
    max_queue: int = 256
    request_timeout: float = 60.0  # seconds; 504 after that
    admin_token: str | None = None  # default: $PRECAST_ADMIN_TOKEN (empty there = unset)
    api_key: str | None = None  # inference endpoints need "Bearer <key>"; default: $PRECAST_API_KEY
    threads: int | None = None  # ORT intra-op threads per session
    instances: int = 1  # batcher worker threads (model calls in parallel)
    drain_timeout: float = 30.0  # graceful shutdown: seconds to finish in-flight requests
    verify: bool = True  # re-run stored parity feeds on load and reload
    # A packed artifact's signed statement, checked at start and on every reload (runtime/signing.py):
    pubkey: Path | None = None  # Ed25519 public key (PEM); None: no signature required
    expect_name: str | None = None  # the signed name must be this
    min_version: str | None = None  # the signed version must be at least this
    log_level: str = "info"
    llm: dict = field(default_factory=dict)  # options handed to the LLM engine (num_blocks, max_tokens, ...)
    # Per-request limits (see the table above).
    max_request_bytes: int = 8 * MiB
    max_inflight_bytes: int | None = None  # default: 8 x max_request_bytes
    max_connections: int = 1024
    max_embedding_inputs: int = 128
    max_embedding_tokens: int = 8192
    max_text_chars: int = 256 * 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    header_timeout: float = 10.0  # seconds a request may take to send its request line and headers
    # The artifact's chat template and tokenizer, per request (text_sandbox.py: a process per call).
    text_timeout: float = 2.0  # seconds one request's render + tokenization may run (504 past it)
    text_memory: int = 128 * MiB  # memory one such call may use (a 400 past it)
    text_workers: int = 64  # such calls at once (more wait, within their request's deadline)

    def __post_init__(self) -> None:
        from precast.runtime.errors import UsageError

        self.artifact = Path(self.artifact)
        if self.admin_token is None:
            self.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
        elif not isinstance(self.admin_token, str):
            raise UsageError(f"admin_token must be a string, got {type(self.admin_token).__name__}")
        elif not self.admin_token.strip():
            # An empty token would match an empty Authorization header: admin open to anyone.
            raise UsageError(
                "--admin-token must not be empty (an empty token would let anyone in); "
                "omit it to keep admin endpoints loopback-only"
            )
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        elif not isinstance(self.api_key, str):
            raise UsageError(f"api_key must be a string, got {type(self.api_key).__name__}")
        elif not self.api_key.strip():
            raise UsageError(
                "--api-key must not be empty (an empty key would let anyone in); omit it for open endpoints"
            )
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
        from precast.runtime.errors import UsageError

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
        from precast.runtime.signing import signature_policy

        return signature_policy(self.pubkey, self.expect_name, self.min_version)

    @classmethod
    def from_options(cls, artifact, **options) -> ServerConfig:
        """From `precast serve`'s flags: the artifact path is checked first, the LLM engine's options
        (LLM_OPTIONS; None = unset) go to ``llm``, everything else is a field."""
        from precast.runtime.errors import UsageError
        from precast.runtime.server.host import check_path

        check_path(artifact)
        llm = {k: v for k in LLM_OPTIONS if (v := options.pop(k, None)) is not None}
        if "num_blocks" in llm and "kv_cache_memory" in llm:
            raise UsageError("--kv-cache-memory and --num-blocks both size the KV pool: give one of them")
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
