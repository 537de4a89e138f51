"""Console helpers: progress and tables on stderr (rich), machine-readable JSON on stdout."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn
from rich.text import Text

from precast.errors import UsageError
from precast.runtime.backends import MAX_THREADS

__all__ = [
    "err_console",
    "out_console",
    "emit_json",
    "format_bytes",
    "Progress",
    "check_output_path",
    "THREADS",
]

# --threads of every command that loads an artifact (run, bench, profile, serve, generate, eval), declared
# once: the runtime's own bound (precast.runtime.load checks it too), checked by click first. Use as @THREADS.
THREADS = click.option(
    "--threads",
    default=None,
    type=click.IntRange(1, MAX_THREADS),
    help="Intra-op threads of each session (default: the artifact's setting).",
)


# Piped or redirected output has no terminal width; rich would assume 80 columns and cut table cells (pass
# names, pipelines) with an ellipsis. COLUMNS still wins when set.
def _width(stream) -> int | None:
    return None if stream.isatty() or "COLUMNS" in os.environ else 200


err_console = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))
out_console = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def format_bytes(n: int) -> str:
    """Decimal units, as file managers and `ls -h --si` show them: 950 B, 12.3 kB, 87.6 MB, 1.2 GB."""
    if n < 1000:
        return f"{n} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 999.95 or unit == "TB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


class Progress:
    """precast.runtime.progress.ProgressReporter on stderr, also callable(msg) (the older one-message API).

    On a terminal: one live line (spinner, the step, a bar and count when the total is known, what is in hand,
    the step's elapsed time) that goes when the step ends; notes print above it and stay. Elsewhere (CI logs,
    a pipe): plain lines, no ANSI and no redraws: a step gets a line once it has run ``plain_after`` seconds
    (quick steps, such as most passes, say what they did in their note), and its advance at most every
    ``plain_every`` seconds. Silent with ``quiet`` (--quiet, --json). Use it as a context manager, so that an
    error stops the live line before the error is printed.
    """

    def __init__(
        self,
        quiet: bool = False,
        console: Console | None = None,
        plain_after: float = 0.5,
        plain_every: float = 5.0,
    ):
        self.quiet = quiet
        self.console = console or err_console
        self.plain_after = plain_after
        self.plain_every = plain_every
        self._t0 = time.monotonic()
        self._live = None  # rich.progress.Progress while a step is shown on a terminal
        self._task = None
        self._lock = threading.Lock()  # plain mode: the timer thread prints a slow step's line
        self._timer: threading.Timer | None = None
        self._pending: str | None = None  # plain mode: the step whose line is not printed yet
        self._last_line = 0.0

    def __call__(self, msg: str) -> None:
        self.note(msg)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.done()

    def step(self, name: str) -> None:
        if self.quiet:
            return
        if self.console.is_interactive:
            live = self._start()
            if self._task is not None:
                live.remove_task(self._task)
            self._task = live.add_task(escape(name), total=None, what="")
            return
        with self._lock:
            self._end_plain_step()
            self._pending = name
            self._timer = threading.Timer(self.plain_after, self._show_pending)
            self._timer.daemon = True
            self._timer.start()

    def advance(self, done: int, total: int | None = None, what: str = "") -> None:
        if self.quiet:
            return
        if self._live is not None and self._task is not None:
            self._live.update(self._task, completed=done, total=total, what=escape(what))
            return
        with self._lock:
            if self._live is None and time.monotonic() - self._last_line >= self.plain_every:
                self._print_pending()
                self._last_line = time.monotonic()
                count = f"{done}/{total}" if total else str(done)
                self.console.print(escape(f"  {count} {what}".rstrip()))

    def note(self, message: str) -> None:
        if self.quiet:
            return
        if self._live is not None:
            self._live.console.print(f"[dim]•[/dim] {escape(message)}")
            return
        with self._lock:
            self.console.print(f"[dim]•[/dim] {escape(message)}")

    def done(self) -> None:
        if self._live is not None:
            self._live.stop()
        self._live = self._task = None
        with self._lock:
            self._end_plain_step()

    def _end_plain_step(self) -> None:
        """(lock held) A step is over; one quicker than ``plain_after`` never gets its own line."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._pending = None

    def _show_pending(self) -> None:
        with self._lock:
            self._print_pending()

    def _print_pending(self) -> None:
        if self._pending is not None:
            self._last_line = time.monotonic()
            at = self._last_line - self._t0
            self.console.print(f"[dim]•[/dim] {escape(self._pending)} [dim](at {at:.1f}s)[/dim]")
            self._pending = None

    def _start(self):
        if self._live is None:
            from rich.progress import Progress as Live
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._live = Live(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                _IfTotal(BarColumn(bar_width=24)),
                _IfTotal(MofNCompleteColumn()),
                TextColumn("[dim]{task.fields[what]}[/dim]"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
                redirect_stdout=False,  # stdout may be JSON for a pipe: never touch it
            )
            self._live.start()
        return self._live


class _IfTotal(ProgressColumn):
    """A column drawn only when the step's total is known (a bar of an unknown total would only pulse)."""

    def __init__(self, inner: ProgressColumn):
        super().__init__()
        self.inner = inner

    def render(self, task):
        return self.inner.render(task) if task.total is not None else Text("")


def check_output_path(path: str | os.PathLike, option: str, *, directory: bool = False) -> None:
    """Fail before any work when ``option``'s path cannot be written: a directory where a file goes (or the
    reverse), an ancestor that is a file, a read-only parent, or a place inside an existing artifact (an
    unlisted file there breaks the artifact's integrity check)."""
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        what = "a directory; give a file path" if p.is_dir() else "a file, not a directory"
        raise UsageError(f"{option} {path}: is {what}")
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: {parent} is not writable")
    for above in p.absolute().parents:
        if (above / "manifest.json").is_file() or (above / "seq2seq.json").is_file():
            raise UsageError(
                f"{option} {path}: inside the artifact {above}; a file written there would break its integrity"
            )
