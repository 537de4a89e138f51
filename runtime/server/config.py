"""Server settings (what `precast serve` flags fill in)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ADMIN_TOKEN_ENV", "ServerConfig", "is_loopback"]

ADMIN_TOKEN_ENV = "PRECAST_ADMIN_TOKEN"


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
    admin_token: str | None = None  # default: $PRECAST_ADMIN_TOKEN
    threads: int | None = None  # ORT intra-op threads per session
    instances: int = 1  # batcher worker threads (model calls in parallel)
    drain_timeout: float = 30.0  # graceful shutdown: seconds to finish in-flight requests
    verify: bool = True  # re-run stored parity feeds on load and reload
    log_level: str = "info"
    llm: dict = field(default_factory=dict)  # options handed to the LLM engine (num_blocks, max_tokens, ...)

    def __post_init__(self) -> None:
        self.artifact = Path(self.artifact)
        if self.admin_token is None:
            self.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None

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
