"""Give the memory a large request used back to the OS once it is freed (glibc's malloc_trim; Linux).

glibc keeps freed memory in its arenas, one per thread that contended for malloc (the request thread
pool's, the tokenizer's worker threads), so after a few large requests were parsed and tokenized in
parallel their peak stays as the server's RSS (measured: 120 -> 180 MB after 10 s of 8 MiB bodies, then
flat; not a leak, but a server sized for its model would be pushed over its memory limit).
``malloc_trim(0)`` returns the free pages of every arena. It runs in a worker thread when the last large
request in flight finishes: one at a time, and once more if another large request finished meanwhile.
Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sys

__all__ = ["Trimmer", "malloc_trim"]

# Bodies from this size on go through large temporary buffers (the body, its text, the parsed value,
# the tokenizer's work): worth a trim. Small requests reuse what malloc already holds.
LARGE_REQUEST_BYTES = 128 << 10


def _load_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _load_trim()


def malloc_trim() -> None:
    if _TRIM is not None:
        _TRIM(0)


class Trimmer:
    """Counts large requests in flight; trims after the last one (one event loop: no lock needed)."""

    def __init__(self) -> None:
        self.large_inflight = 0
        self._running = False
        self._again = False

    def started(self, body_bytes: int) -> bool:
        if _TRIM is None or body_bytes < LARGE_REQUEST_BYTES:
            return False
        self.large_inflight += 1
        return True

    def finished(self) -> None:
        self.large_inflight -= 1
        if self.large_inflight == 0:
            self._request()

    def _request(self) -> None:
        if self._running:
            self._again = True
            return
        self._running = True
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, malloc_trim).add_done_callback(lambda _: self._done())

    def _done(self) -> None:
        self._running = False
        if self._again:
            self._again = False
            self._request()
