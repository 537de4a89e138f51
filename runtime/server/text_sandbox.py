"""The server's side of text_worker.py: an artifact's chat template and tokenizer, run where they can be stopped.

``TextSandbox.start()`` launches the zygote (``python -m precast.runtime.server.text_worker``, in its own
process group) with the template and tokenizer; ``call(op, args, timeout)`` returns a Future, resolved by one
reader thread; ``await acall(...)`` is the same for the event loop (cancelling it kills the call's child).
No call holds a thread of the server while it runs. ``close()`` kills the zygote's process group, its
children included; a zygote that died (killed, crashed) is started again by the next ``acall``.

Errors: a wrong input (the template raised, the rendered prompt is too long) is LLMRequestError (a 400);
a call past its deadline is TextTimeout (a 504); a call that blew its memory or CPU limit is TextFailed (a
400 naming the limit: the artifact's code cannot handle this input within the server's bounds); a worker that
died (killed, out of memory) or a server that is stopping is TextUnavailable (a 503: retry).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from precast.errors import ArtifactError, LLMRequestError, PrecastError
from precast.runtime.server.text_worker import read_frame, write_frame

__all__ = ["TextFailed", "TextLimits", "TextSandbox", "TextTimeout", "TextUnavailable"]

MiB = 1 << 20
CHARS_PER_BUDGET = 1 << 16  # a call may run the limits' timeout per started 64 Ki characters of its input
BYTES_PER_CHAR = 128  # ... and use the limits' memory + this per character (tokenizing takes ~50-100 B/char)


@dataclass(frozen=True)
class TextLimits:
    """What one call may cost (`precast serve --text-timeout/--text-memory/--text-workers`)."""

    # seconds one call (render + tokenize) may run per started CHARS_PER_BUDGET characters of input; the
    # request's own deadline too
    timeout: float = 2.0
    memory: int = 128 * MiB  # address space one call may add to the worker's (+ 128 B per input character)
    workers: int = 64  # calls running at once (more wait in order, within their deadline)

    def __post_init__(self) -> None:
        from precast.errors import UsageError

        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise UsageError(f"text_timeout must be a positive number of seconds, got {self.timeout!r}")
        for name in ("memory", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"text_{name} must be a positive integer, got {v!r}")
        if self.memory < 16 * MiB or self.memory > 1 << 40:
            raise UsageError(f"text_memory must be 16 MiB to 1 TiB, got {self.memory} bytes")
        if self.timeout > 3600:
            raise UsageError(f"text_timeout must be at most 3600 s, got {self.timeout!r}")
        if self.workers > 4096:
            raise UsageError(f"text_workers must be at most 4096, got {self.workers!r}")


class TextTimeout(PrecastError):
    """The chat template or tokenizer ran past its deadline."""


class TextUnavailable(PrecastError):
    """The sandbox cannot take the call now (its worker died and is restarting, or the server is stopping): a
    503, the client may retry."""


class TextFailed(LLMRequestError):
    """The chat template or tokenizer went over its memory or CPU limit on this input."""


class TextSandbox:
    def __init__(
        self,
        *,
        template: str | None,
        tokenizer: str | None,
        limits: TextLimits = TextLimits(),
        plain_tokenizer: bool = False,
        what: str = "the artifact's chat template or tokenizer",
    ):
        self.template = template
        self.tokenizer = tokenizer
        self.limits = limits
        self.plain_tokenizer = plain_tokenizer
        self.what = what
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # the zygote's stdin, _pending, _proc
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self._launching: Future | None = None

    # -- life ---------------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> TextSandbox:
        """Launch the zygote and wait for it to load the template and tokenizer (ArtifactError if it cannot)."""
        with self._lock:
            self._launch(timeout)
        return self

    def _launch(self, timeout: float) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "precast.runtime.server.text_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: close() kills it and every child at once
            env=env,
        )
        init = {
            "template": self.template,
            "tokenizer": self.tokenizer,
            "plain": self.plain_tokenizer,
            "memory": self.limits.memory,
            "max_live": self.limits.workers,
        }
        ready: dict = {}

        def handshake():
            try:
                write_frame(proc.stdin.fileno(), init)
                ready.update(read_frame(proc.stdout.fileno()) or {})
            except (OSError, ValueError):
                pass

        t = threading.Thread(target=handshake, daemon=True)
        t.start()
        t.join(timeout)
        if not ready.get("ready"):
            _kill_group(proc)
            why = ready.get("error") or (
                f"did not load within {timeout:g} s" if t.is_alive() else "its worker process exited"
            )
            raise ArtifactError(f"{self.what}: {why}")
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="precast-text-reader", daemon=True).start()

    def close(self) -> None:
        """Kill the zygote and its children (idempotent); pending calls fail."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            _kill_group(proc)
        self._fail_all("the server is shutting down")  # (TextUnavailable: a 503)

    @property
    def running(self) -> int:
        """Calls in flight (sent, not answered)."""
        return len(self._pending)

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _relaunch(self) -> Future:
        """A Future of the zygote's restart, started once in a background thread however many calls wait."""
        with self._lock:
            if self._launching is None:
                fut: Future = Future()
                self._launching = fut

                def run():
                    try:
                        with self._lock:
                            if self._closed:
                                raise TextUnavailable("the server is shutting down")
                            if not self._alive():
                                self._launch(60.0)
                        fut.set_result(None)
                    except BaseException as e:  # noqa: BLE001  (handed to every waiter)
                        fut.set_exception(e)
                    finally:
                        with self._lock:
                            self._launching = None

                threading.Thread(target=run, name="precast-text-launch", daemon=True).start()
            return self._launching

    # -- calls --------------------------------------------------------------------------------------------
    def call(self, op: str, args: dict, timeout: float | None = None, chars: int = 0) -> Future:
        """Run ``op`` (``chat`` or ``encode``, see text_worker): answered within ``timeout`` s (the request's
        time left; waiting for a free worker included), running at most the limits' timeout per started
        CHARS_PER_BUDGET characters of input (``chars``: tokenizing a long prompt takes longer), with the limits'
        memory + BYTES_PER_CHAR per character. The Future holds the result, or raises LLMRequestError /
        TextTimeout / TextFailed; a zygote that is not running is TextUnavailable here (acall restarts it)."""
        budget = self.limits.timeout * max(1, -(-chars // CHARS_PER_BUDGET))
        memory = self.limits.memory + BYTES_PER_CHAR * chars
        expires = budget if timeout is None else max(0.0, timeout)
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise TextUnavailable("the server is shutting down")
            if not self._alive():
                raise TextUnavailable(f"{self.what}: its worker process exited; try again")
            cid = next(self._ids)
            fut.call_id = cid  # type: ignore[attr-defined]
            fut.budget = budget  # type: ignore[attr-defined]
            fut.proc = self._proc  # type: ignore[attr-defined]  (the zygote that owes the answer)
            self._pending[cid] = fut
            try:
                write_frame(
                    self._proc.stdin.fileno(),
                    {
                        "id": cid,
                        "op": op,
                        "args": args,
                        "timeout": budget,
                        "expires": expires,
                        "memory": memory,
                    },
                )
            except OSError:
                self._pending.pop(cid, None)
                raise TextUnavailable(f"{self.what}: its worker process exited; try again") from None
        return fut

    async def acall(self, op: str, args: dict, timeout: float | None = None, chars: int = 0):
        if not self._alive():  # restarted off the event loop, once
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(asyncio.wrap_future(self._relaunch()), timeout)
            except asyncio.TimeoutError:
                raise TextTimeout(f"{self.what}: its worker process is restarting; try again") from None
            except ArtifactError as e:
                raise TextUnavailable(str(e)) from None
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - t0))
        fut = self.call(op, args, timeout, chars)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(fut)
            raise

    def cancel(self, fut: Future) -> None:
        """Stop the call's child now (the client went away)."""
        cid = getattr(fut, "call_id", None)
        with self._lock:
            if cid not in self._pending or self._proc is None:
                return
            try:
                write_frame(self._proc.stdin.fileno(), {"cancel": cid})
            except OSError:
                pass

    # -- the reader thread ---------------------------------------------------------------------------------
    def _read(self, proc: subprocess.Popen) -> None:
        fd = proc.stdout.fileno()
        while True:
            try:
                msg = read_frame(fd)
            except (OSError, ValueError):
                msg = None
            if msg is None:
                break
            fut = self._pending.pop(msg.get("id"), None)
            if fut is None or fut.done():
                continue
            if "ok" in msg:
                fut.set_result(msg["ok"])
            else:
                fut.set_exception(self._error(msg, fut))
        with self._lock:
            if self._proc is proc:
                self._proc = None
        _kill_group(proc)  # its children too: the group outlives its leader
        why = (
            "the server is shutting down"
            if self._closed
            else f"{self.what}: its worker process exited; try again"
        )
        self._fail_all(why, proc)

    def _error(self, msg: dict, fut: Future) -> Exception:
        kind, line = msg.get("error"), msg.get("message", "")
        if kind == "request":
            return LLMRequestError(line)
        if kind == "timeout":
            return TextTimeout(
                f"{self.what} did not finish this request within its time (--text-timeout {fut.budget:g} s, "
                "or the request's own deadline)"
            )
        if kind == "cancelled":
            return TextFailed("cancelled")
        limit = f"--text-memory {self.limits.memory // MiB} MiB"
        if kind == "memory":
            return TextFailed(f"{self.what} ran out of its memory ({limit}) on this request")
        return TextFailed(f"{self.what} {line} on this request ({limit})")

    def _fail_all(self, why: str, proc: subprocess.Popen | None = None) -> None:
        """Fail the pending calls (of zygote ``proc`` only, when given: a relaunched one has its own)."""
        with self._lock:
            gone = [c for c, f in self._pending.items() if proc is None or getattr(f, "proc", None) is proc]
            futs = [self._pending.pop(c) for c in gone]
        for fut in futs:
            if not fut.done():
                fut.set_exception(TextUnavailable(why))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
