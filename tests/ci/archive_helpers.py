"""Builders for packed artifacts, honest and hostile."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def members_of(packed: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(packed) as tf:
        return [(m, tf.extractfile(m).read() if m.isfile() else b"") for m in tf.getmembers()]


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    return ti, b""


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
