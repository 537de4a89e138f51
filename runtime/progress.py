"""Progress of long steps, as plain calls: the compiler and the runtime report it, the CLI draws it.

    step(name)                       a new step starts (the previous one is over): "exporting ... with torch.export"
    advance(done, total, what)       progress inside the step: ``done`` of ``total`` units (None: unknown),
                                     ``what`` is the unit in hand ("MatMul 'q_proj' (3 of 14)")
    note(message)                    a line that stays (a pass's stats, a target's note)
    done()                           no more steps: stop any live display

A library function takes ``progress: ProgressReporter | callable | None`` and calls ``reporter(progress)``: None
is silent, and a plain ``callable(str)`` (the older API) receives each step's name and each note.
Standard library only: the runtime imports it, and the CLI (cli/output.py) implements it with rich.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["ProgressReporter", "SilentProgress", "CallbackProgress", "SILENT", "reporter"]


@runtime_checkable
class ProgressReporter(Protocol):
    def step(self, name: str) -> None: ...

    def advance(self, done: int, total: int | None = None, what: str = "") -> None: ...

    def note(self, message: str) -> None: ...

    def done(self) -> None: ...


class SilentProgress:
    """Reports nothing (``-q``, ``--json``, library callers that passed no progress)."""

    def step(self, name: str) -> None:
        pass

    def advance(self, done: int, total: int | None = None, what: str = "") -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def done(self) -> None:
        pass


SILENT = SilentProgress()


class CallbackProgress(SilentProgress):
    """A ``callable(message)``: step names and notes go to it; advances do not (one line per layer would flood it)."""

    def __init__(self, fn: Callable[[str], None]):
        self.fn = fn

    def step(self, name: str) -> None:
        self.fn(name)

    def note(self, message: str) -> None:
        self.fn(message)


def reporter(progress: ProgressReporter | Callable[[str], None] | None) -> ProgressReporter:
    """``progress`` as a ProgressReporter: None -> silent, a reporter as is, a plain callable -> CallbackProgress."""
    if progress is None:
        return SILENT
    if isinstance(progress, ProgressReporter):
        return progress
    if callable(progress):
        return CallbackProgress(progress)
    raise TypeError(f"progress must be a ProgressReporter or a callable, got {type(progress).__name__}")
