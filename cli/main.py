"""``precast`` CLI entry point. Errors become one line on stderr and a documented exit code."""

from __future__ import annotations

import sys
import traceback

import click

from precast.errors import EXIT_INTERNAL, EXIT_USAGE, PrecastError, first_line

__all__ = ["cli", "main"]


class _Group(click.Group):
    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is None and name:
            import difflib

            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise click.UsageError(f"unknown command '{name}'{hint}")
        return cmd


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="precast", prog_name="precast")
def cli(debug: bool) -> None:
    """precast: compile models into verified per-target artifacts, and run them.

    \b
    Exit codes: 0 ok, 1 usage or bad input, 2 parity failure, 3 artifact error
    (missing, tampered, newer schema), 4 target unknown/unavailable, 5 export or pass failure,
    70 internal error.
    """


def _register() -> None:
    from precast.cli import (
        commands,  # noqa: F401  (defines the subcommands on `cli`)
        commands_bench,  # noqa: F401  (bench)
        commands_ci,  # noqa: F401  (bisect, pack, unpack, keygen, profile)
        commands_compile,  # noqa: F401  (compile)
        commands_eval,  # noqa: F401  (eval --perplexity)
        commands_llm,  # noqa: F401  (generate)
        commands_serve,  # noqa: F401  (serve)
    )


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the process's own command line: it ends with this command
        _skip_shutdown_gc()
    args = list(sys.argv[1:] if argv is None else argv)
    # --debug works anywhere on the line (README lists it beside the compile options), not only before the
    # subcommand; what follows a bare "--" is left alone.
    end = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:end]
    if debug:
        args = ["--debug"] + [a for a in args[:end] if a != "--debug"] + args[end:]
    _register()
    try:
        rv = cli.main(args=args, prog_name="precast", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(EXIT_USAGE)
    except PrecastError as e:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except OSError as e:
        if e.filename is None:  # not about a path the user named: handled as a bug below
            _internal(e, debug)
        if debug:
            traceback.print_exc()
        click.echo(f"error: cannot use '{e.filename}': {e.strerror or e}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as e:  # a bug in precast, not a user mistake
        _internal(e, debug)
    sys.exit(rv if isinstance(rv, int) else 0)


def _skip_shutdown_gc() -> None:
    """Exit as soon as the command is done. CPython's shutdown runs four full cyclic-GC passes (Py_FinalizeEx,
    finalize_modules, finalize_interp_clear), each over every live object; after a torch export that is ~550k
    objects of ~4,000 modules (torch, dynamo, sympy, transformers), 0.5-1 s a pass: the 2-5 s wait after
    "wrote ...". gc.freeze() as the last exit handler (atexit runs last what was registered first) moves them
    out of the collector's sight; the other exit handlers (temp dir cleanup) still run before it, and
    refcounting still frees what the module teardown releases. Only for the process's own command line: a
    caller of main(argv) (tests) keeps its collector."""
    import atexit
    import gc

    atexit.register(gc.freeze)


def _internal(e: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exc()
        click.echo(f"internal error: {first_line(e, with_type=True)}", err=True)
    else:
        click.echo(
            f"internal error: {first_line(e, with_type=True)} (re-run with --debug for the traceback)",
            err=True,
        )
    sys.exit(EXIT_INTERNAL)
