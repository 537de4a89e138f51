"""Console helpers: progress and tables on stderr (rich), machine-readable JSON on stdout."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.markup import escape

__all__ = ["err_console", "out_console", "emit_json", "Progress"]

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
out_console = Console(highlight=False, soft_wrap=True)


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class Progress:
    """A progress line per step on stderr; silent with --quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            err_console.print(f"[dim]•[/dim] {escape(msg)}")
