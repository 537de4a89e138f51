"""A ProgressReporter that records its calls, for tests of the progress hooks."""

from __future__ import annotations

__all__ = ["RecordingProgress"]


class RecordingProgress:
    def __init__(self):
        self.calls: list[
            tuple
        ] = []  # ("step", name) | ("advance", done, total, what) | ("note", msg) | ("done",)

    def step(self, name: str) -> None:
        self.calls.append(("step", name))

    def advance(self, done: int, total: int | None = None, what: str = "") -> None:
        self.calls.append(("advance", done, total, what))

    def note(self, message: str) -> None:
        self.calls.append(("note", message))

    def done(self) -> None:
        self.calls.append(("done",))

    @property
    def steps(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "step"]

    @property
    def notes(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "note"]

    def advances(self, after_step: str | None = None) -> list[tuple[int, int | None, str]]:
        """(done, total, what) of every advance, or of those reported inside the first step containing ``after_step``."""
        out, inside = [], after_step is None
        for c in self.calls:
            if c[0] == "step" and after_step is not None:
                inside = after_step in c[1] and not out
            elif c[0] == "advance" and inside:
                out.append(c[1:])
        return out
