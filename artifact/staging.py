"""Names of precast's temporary entries, and the cleanup of those a killed compile or unpack left behind.

It lives in the runtime (standard library only) because ``precast unpack`` stages there too.

Every temporary sibling precast creates (a staging dir, an artifact being replaced, a cache entry being
copied or removed, a pack being written) is named

    .<name>.<kind>-<pid>-<host>-<random>        e.g. .model.tmp-41327-3fa9c2d0-8b1e77aa

with the creating process's id and a hash of its host (hostname + pid namespace), so the next compile can tell
a dead owner's leftover from a running compile's stage: an entry is stale when its owner ran on this host and
is gone. Names written before owners were recorded (``.<name>.<kind>-<random>``) are stale after
``LEGACY_STALE_AFTER_S``, and so are entries of other hosts (a shared volume: their pids mean nothing here).
Cleanup never follows a symlink, touches only entries owned by this user, and never fails a compile.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["KINDS", "LEGACY_STALE_AFTER_S", "temp_name", "clean_stale", "host_id"]

KINDS = ("tmp", "old", "trash", "unpack")
LEGACY_STALE_AFTER_S = 24 * 3600  # an owner we cannot ask (old name, other host): a day without a change
_NAME = re.compile(
    r"^\.(?P<base>.+)\.(?P<kind>tmp|old|trash|unpack)-(?P<pid>[0-9]{1,10})-(?P<host>[0-9a-f]{8})-[0-9a-f]{8}$"
)
_LEGACY = re.compile(r"^\.(?P<base>.+)\.(?P<kind>tmp|old|trash)-[0-9a-f]{8}$")


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """8 hex digits naming this host and pid namespace (containers on one host have their own pids)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]


def temp_name(base: str, kind: str = "tmp") -> str:
    """A fresh temporary name for a sibling of ``base`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown temp kind {kind!r}")
    return f".{base}.{kind}-{os.getpid()}-{host_id()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as e:  # EPERM: alive, another user's; anything else: do not guess it is dead
        return e.errno != errno.ESRCH
    return True


def _stale_kind(
    name: str, st: os.stat_result, legacy: Callable[[str], bool] | None, now: float
) -> str | None:
    """The kind ('tmp', 'old', 'trash') of a stale precast temp entry, or None when it is not one."""
    m = _NAME.match(name)
    if m:
        if m["host"] == host_id():
            return None if _pid_alive(int(m["pid"])) else m["kind"]
        return m["kind"] if now - st.st_mtime > LEGACY_STALE_AFTER_S else None
    m = _LEGACY.match(name)
    if m and legacy is not None and legacy(m["base"]) and now - st.st_mtime > LEGACY_STALE_AFTER_S:
        return m["kind"]
    return None


def clean_stale(
    folder: str | os.PathLike,
    legacy: Callable[[str], bool] | None = None,
    old_ok: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """Remove precast's stale temporary entries directly inside ``folder``; returns what was removed.

    ``legacy``: which base names' old-style (owner-less) temp entries may go too (e.g. the output's own
    name); without it only entries that carry their owner are considered. ``old_ok``: an ``old`` entry (an
    output moved aside to be replaced) goes only when this says it is still what precast may delete (a
    publish that failed to put a refused folder back leaves it under that name); without it, never.
    """
    folder = Path(folder)
    now = time.time()
    removed = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return removed
    for name in names:
        if not name.startswith("."):
            continue
        path = folder / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # precast creates plain dirs and files; a link (or a fifo, a device) by that name is someone else's
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) or st.st_uid != os.getuid():
            continue
        kind = _stale_kind(name, st, legacy, now)
        if kind is None or (kind == "old" and (old_ok is None or not old_ok(path))):
            continue
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)  # does not follow symlinks inside (and refuses a symlinked root)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            continue  # a concurrent cleaner got there first, or a file we cannot remove: not our failure
    return removed
