"""Typed errors shared by the compiler and the runtime.

Every error carries a one-line message naming the culprit and an exit code the CLI maps it to.
They live in the runtime package because the runtime must not import the compiler, while the compiler
may import the runtime.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CODES",
    "first_line",
    "PrecastError",
    "UsageError",
    "InputError",
    "ModelLoadError",
    "ExportError",
    "PipelineError",
    "UnknownPassError",
    "PassOptionError",
    "PassFailedError",
    "NativeCrashError",
    "PartialCompileError",
    "UnsupportedOpError",
    "TargetUnavailableError",
    "UnknownTargetError",
    "ParityError",
    "ArtifactError",
    "IntegrityError",
    "SchemaVersionError",
    "LLMRequestError",
    "RequestCancelledError",
]

# Documented exit codes (README "Exit codes").
EXIT_OK = 0
EXIT_USAGE = 1  # bad command line, bad input file, bad feeds
EXIT_PARITY = 2  # compiled model numerically wrong
EXIT_ARTIFACT = 3  # artifact missing, tampered, or of an unknown schema
EXIT_TARGET = 4  # target unknown or unavailable on this host
EXIT_COMPILE = 5  # export or pass failure
EXIT_INTERNAL = 70  # a bug in precast


class PrecastError(Exception):
    """Base class: a one-line, user-facing message and an exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # keep it one line
        return " ".join(self.message.split("\n"))


class UsageError(PrecastError):
    """Bad option or argument."""


class InputError(PrecastError):
    """Feeds that do not match the model's IO signature (name, dtype, rank, static dim)."""


class ModelLoadError(PrecastError):
    """The source model is missing, not ONNX, truncated, or otherwise unreadable."""


class ExportError(PrecastError):
    """torch / Hugging Face export failed."""

    exit_code = EXIT_COMPILE


class PipelineError(PrecastError):
    """Pipeline string syntax error (points at the column)."""


class UnknownPassError(PipelineError):
    """No pass is registered under that name."""


class PassOptionError(PipelineError):
    """Unknown or badly typed pass option."""


class PassFailedError(PrecastError):
    """A pass raised while transforming the model."""

    exit_code = EXIT_COMPILE


class NativeCrashError(PassFailedError):
    """A vendor library crashed (a signal such as SIGSEGV), exited or hung in the child process precast ran it
    in (``precast.targets.isolated``); the compile is refused with the target, the stage and the signal."""

    def __init__(self, message: str, *, signal: str = "", stderr_tail: str = ""):
        super().__init__(message)
        self.signal = signal
        self.stderr_tail = stderr_tail


class PartialCompileError(PrecastError):
    """A multi-target compile wrote the targets that verified, but not these (``failed``: target -> its error).
    The exit code is the first failed target's; ``result`` is the CompileResult of what was written."""

    def __init__(self, message: str, *, exit_code: int, failed: dict, result=None):
        super().__init__(message)
        self.exit_code = exit_code
        self.failed = failed
        self.result = result


class UnsupportedOpError(PrecastError):
    """The target's runtime cannot run a node of the model."""

    exit_code = EXIT_COMPILE


class UnknownTargetError(PrecastError):
    exit_code = EXIT_TARGET


class TargetUnavailableError(PrecastError):
    exit_code = EXIT_TARGET


class ParityError(PrecastError):
    """The compiled model's outputs differ from the reference beyond tolerance."""

    exit_code = EXIT_PARITY

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


class ArtifactError(PrecastError):
    """The artifact is missing, malformed or cannot be loaded."""

    exit_code = EXIT_ARTIFACT


class IntegrityError(ArtifactError):
    """A file of the artifact does not match its recorded sha256 (or is missing / extra)."""


class SchemaVersionError(ArtifactError):
    """The artifact was written by a newer precast (unknown manifest schema)."""


class LLMRequestError(PrecastError):
    """A generation request the LLM engine refuses (too long, bad sampling option, unknown token id)."""


class RequestCancelledError(LLMRequestError):
    """The request was cancelled; its tokens will not come."""


EXIT_CODES = {
    "ok": EXIT_OK,
    "usage / bad input": EXIT_USAGE,
    "parity failure": EXIT_PARITY,
    "artifact error (missing, tampered, newer schema)": EXIT_ARTIFACT,
    "target unknown or unavailable": EXIT_TARGET,
    "export or pass failure": EXIT_COMPILE,
    "internal error (bug)": EXIT_INTERNAL,
}


def first_line(e: BaseException, *, with_type: bool = False) -> str:
    """An exception's message cut to its first non-blank line (the type's name when it has none), for one-line
    errors; the one helper for this (never ``str(e).splitlines()[0]``, which fails on an empty message).
    ``with_type`` prefixes the type's name: "ValueError: ..."."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0].rstrip()
    return f"{type(e).__name__}: {line}" if with_type else line
