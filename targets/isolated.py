"""Run a step that calls into a vendor library in a child process: a native crash becomes an error.

    parent                                              child: python -P -m precast.targets.isolated
    run_isolated("qnn-compile", {...}, what=...) --stdin-->  {"entry": "precast.targets._qnn_native:...", ...}
        result / typed error         <--private pipe--  entry(payload) -> JSON-able dict
        signal, exit code, timeout   <--wait status--   (SIGSEGV in the vendor library: the child dies alone)
        stderr tail                  <--temp file---    vendor logs, faulthandler's Python traceback

A vendor library that segfaults (QNN's HTP compiler on a graph it cannot take) would otherwise take the whole
compile down with exit 139 and no message. In a child, the parent sees the signal and raises
``NativeCrashError`` (exit 5) naming the step; a multi-target compile can go on with the other targets.

Entry points are named in ``ENTRIES``, precast's own table: the name a caller passes, never a string from the
command line or an artifact, chooses the function. The child starts with ``-P`` so a module in the working
directory cannot shadow precast's or a vendor's, and its stdout is moved onto stderr before the entry runs
(native code printing to fd 1 cannot corrupt the result). A Python error in the entry that is a
``PrecastError`` is re-raised in the parent with its type and message; any other one is a bug (exit 70).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

from precast import errors
from precast.errors import NativeCrashError, PrecastError, first_line

__all__ = ["ENTRIES", "ChildResult", "run_isolated"]

# name -> "module:function"; the function takes the JSON payload (a dict) and returns a JSON-able dict.
ENTRIES: dict[str, str] = {
    "qnn-placement": "precast.targets._qnn_native:placement",
    "qnn-compile": "precast.targets._qnn_native:compile_ep_context",
}

TAIL_BYTES = (
    64 << 20
)  # the child's stderr kept for the caller: QNN's verbose placement log of a BERT is ~1 MB
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class ChildResult:
    value: dict[str, Any]  # what the entry returned
    stderr_tail: str  # the vendor's log lines (ANSI colours removed), for callers that read them


def _command() -> list[str]:
    # -P (3.11+): no working-directory entry on sys.path; -I on older Pythons (also drops PYTHONPATH).
    flag = "-P" if sys.version_info >= (3, 11) else "-I"
    return [sys.executable, flag, "-m", __name__]


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own group: helpers it forked go too
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - TAIL_BYTES))
    return _ANSI.sub("", f.read().decode("utf-8", errors="replace"))


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def run_isolated(entry: str, payload: dict[str, Any], *, what: str, timeout: float) -> ChildResult:
    """Run ``ENTRIES[entry](payload)`` in a child process; its dict and stderr tail come back.

    ``what`` names the step for the error ("target 'ort-qnn' stage 'ep-context compile'"). A child killed by a
    signal, one that exits without a result, or one still running after ``timeout`` seconds (then killed)
    raises ``NativeCrashError`` carrying the signal and the tail of the child's stderr.
    """
    request = json.dumps({"entry": ENTRIES[entry], "payload": payload}).encode()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            _command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,  # Ctrl-C reaches precast, which then kills the child (below)
        )
        try:
            out, _ = proc.communicate(request, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            raise NativeCrashError(
                f"{what} did not finish in {timeout:g} s and was killed",
                signal="timeout",
                stderr_tail=_tail(err),
            ) from None
        except BaseException:
            _kill(proc)
            proc.wait()
            raise
        rc = proc.returncode
        tail = _tail(err)
    if rc < 0:
        sig = _signal_name(rc)
        raise NativeCrashError(f"{what} crashed ({sig})", signal=sig, stderr_tail=tail)
    try:
        reply = json.loads(out.decode() or "null")
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise NativeCrashError(
            f"{what} exited with code {rc} without a result", signal=f"exit {rc}", stderr_tail=tail
        )
    if "error" in reply:
        raise _rebuild(reply["error"], entry)
    return ChildResult(reply["result"], tail)


def _rebuild(error: dict[str, str], entry: str) -> Exception:
    cls = getattr(errors, error.get("type", ""), None)
    if isinstance(cls, type) and issubclass(cls, PrecastError):
        return cls(error["message"])
    # Not a PrecastError: a bug in precast's entry (exit 70); the child's traceback comes along.
    return RuntimeError(f"{entry} (child process): {error['message']}\n{error.get('traceback', '')}")


def _child() -> None:
    import faulthandler

    faulthandler.enable()  # a native crash leaves the Python stack in the stderr tail
    result_fd = os.dup(1)
    os.dup2(2, 1)  # native code that prints to stdout writes to stderr instead
    sys.stdout = sys.stderr
    request = json.loads(sys.stdin.buffer.read())
    module, _, func = request["entry"].partition(":")
    try:
        result = getattr(importlib.import_module(module), func)(request["payload"])
        reply = json.dumps({"result": result})
    except PrecastError as e:
        reply = json.dumps({"error": {"type": type(e).__name__, "message": e.message}})
    except Exception as e:
        error = {"type": "", "message": first_line(e, with_type=True), "traceback": traceback.format_exc()}
        reply = json.dumps({"error": error})
    with os.fdopen(result_fd, "w") as out:
        out.write(reply)


if __name__ == "__main__":
    _child()
