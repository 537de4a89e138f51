"""Run the precast CLI in-process and capture (exit code, stdout, stderr)."""

from __future__ import annotations

from precast.cli.main import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
