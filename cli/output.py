"""Console helpers: progress and tables on stderr (rich), machine-readable JSON on stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from precast.runtime.backends import MAX_THREADS
from precast.runtime.errors import UsageError

__all__ = ["err_console", "out_console", "emit_json", "Progress", "check_output_path", "THREADS"]

# --threads of every command: the runtime's own bound (precast.runtime.load checks it too), checked by click first
THREADS = click.IntRange(1, MAX_THREADS)


# Piped or redirected output has no terminal width; rich would assume 80 columns and cut table cells (pass
# names, pipelines) with an ellipsis. COLUMNS still wins when set.
def _width(stream) -> int | None:
    return None if stream.isatty() or "COLUMNS" in os.environ else 200


err_console = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))
out_console = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class Progress:
    """A progress line per step on stderr; silent with --quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            err_console.print(f"[dim]•[/dim] {escape(msg)}")


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
        if (above / "manifest.json").is_file():
            raise UsageError(
                f"{option} {path}: inside the artifact {above}; a file written there would break its integrity"
            )
