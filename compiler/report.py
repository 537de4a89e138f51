"""What a compile returns: ``CompileReport`` (the CLI prints it and writes it as ``--report`` JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from precast.errors import ParityError, PartialCompileError, PrecastError
from precast.ir.pipeline import PassRecord

__all__ = ["CompileReport", "CompileResult", "artifact_size"]


@dataclass
class CompileReport:
    output: Path
    manifest: dict
    records: dict[str, list[PassRecord]]  # per target
    seconds: dict[str, float]
    cache: str | None = None  # None (no cache), "hit", "miss" or "corrupt: ..." (rebuilt)
    warnings: list[str] = field(default_factory=list)  # not errors, but the user should hear them
    bytes: int = 0  # the artifact on disk: every file under ``output``
    files: int = 0

    @property
    def artifact(self) -> dict:
        return {"path": str(self.output), "bytes": self.bytes, "files": self.files}

    def to_json(self) -> dict:
        """The ``--report`` JSON of a compile that wrote its artifact."""
        return {
            "ok": True,
            "output": str(self.output),
            "artifact": self.artifact,
            "manifest": self.manifest,
            "cache": self.cache,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "pass_seconds": {t: {r.spec: round(r.seconds, 4) for r in rs} for t, rs in self.records.items()},
        }

    @staticmethod
    def failure_json(e: PrecastError) -> dict:
        """The ``--report`` JSON of a compile that failed with ``e`` (a partial one names what it wrote)."""
        payload = {"ok": False, "error": str(e), "error_type": type(e).__name__, "exit_code": e.exit_code}
        if isinstance(e, ParityError):
            payload["parity"] = {k: v for k, v in e.report.items() if k not in ("inputs", "expected")}
        if isinstance(e, PartialCompileError):  # the targets that verified were written
            payload.update(failed=e.failed, output=str(e.result.output), manifest=e.result.manifest)
        return payload


CompileResult = CompileReport  # the name before the report carried its own JSON


def artifact_size(root: Path) -> tuple[int, int]:
    """(bytes, files) of every regular file under ``root``."""
    sizes = [p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(sizes), len(sizes)
