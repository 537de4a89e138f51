"""ONNX Runtime's thread spinning that follows the host's load: two sessions, one picked per step.

ONNX Runtime's intra-op threads either spin-wait for the next parallel section (its default) or sleep. On
a quiet host spinning wins the wake-up latency back (a decode step of a small model is 1-3 ms, and waking a
sleeping thread costs tens of microseconds several times a step): measured 1.2-1.45x decode tokens/s at
batch 1 on bench_llm.py's models. Under a competing process it loses the time slices the step's own
threads need: 1.6x slower with one core busy (benchmarks/README.md). The setting is fixed when a session
is created, so a runner with ``spinning="auto"`` holds both and asks ``SpinSwitch.session()`` each step:

    the spinning session until this process's threads waited for a CPU ``busy`` or more of their
    runnable time in ``busy_windows`` readings in a row (one every ``interval`` s: 3 x 20 ms), then the
    calm (sleeping) one until a reading is under ``quiet`` (0.05: calm threads queue less than spinning
    ones, 0.14-0.45 under load, so one bound would flap). A burst after idle time (no step for 4
    intervals) starts spinning unless another process's task is runnable at that moment (/proc/loadavg
    less our own runnable threads): three spinning readings under load would cost a 128-token request a
    quarter of its rate. A burst that started calm so asks once more at its next step: the task that sent
    the request (a client process, a server's own thread) is runnable for an instant and gone by then, a
    competing process is not; waiting for the first reading instead ran 20 ms of a ~55 ms small-model
    request calm (bench_llm.py small256: two switches per request, measured).

Why three readings and not one: another process's ORT pool spins on ~40 ms after its last run (measured),
and so does ours after the switch to calm (readings in the ``settle`` time after it are dropped): a short
tail must not turn a whole small-model request calm (a 128-token decode lasts 0.06-0.15 s there).

The signal is the kernel's run-queue delay of our own threads (/proc/self/task/*/schedstat, nanoseconds):
waiting / (running + waiting). It measures what spinning costs (our threads queued behind others, or
behind each other), is exact where /proc/stat's 10 ms ticks are not, and accrues only while our threads
are runnable, so other processes' work while the engine is idle does not count. Measured on a 2-core host
(bench INT4 model, b1 decode): 0.001-0.03 quiet (up to 0.09 right after another process's burst), 0.24-0.47
with one competing busy process, spinning or not: ``busy`` 0.15. A reading costs ~30 us (a few threads'
files), once per interval; a step otherwise pays one clock read. Where schedstat cannot be read (not Linux) the switch stays calm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

__all__ = ["HostLoad", "SpinSwitch", "ThreadFiles", "ThreadWait", "proc_thread_files"]

# name ("schedstat", "stat") -> (tid, that file's contents) of each of our threads alive now
ThreadFiles = Callable[[str], Iterable[tuple[str, bytes]]]


def proc_thread_files(task_dir: str = "/proc/self/task") -> ThreadFiles:
    """The kernel's per-thread files of this process (tests pass ThreadWait fake ones instead)."""

    def files(name: str) -> Iterator[tuple[str, bytes]]:
        try:
            tids = os.listdir(task_dir)
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"{task_dir}/{tid}/{name}", "rb") as f:
                    yield tid, f.read()
            except OSError:
                continue  # (a thread that ended meanwhile)

    return files


class HostLoad(Protocol):
    """What SpinSwitch reads: ThreadWait, or a test's scripted readings."""

    available: bool
    last_run_s: float

    def waiting(self) -> float | None: ...

    def others_running(self) -> int | None: ...


class ThreadWait:
    """The share of this process's runnable thread time spent waiting for a CPU since the previous reading."""

    def __init__(self, task_dir: str = "/proc/self/task", *, files: ThreadFiles | None = None):
        self._files = files if files is not None else proc_thread_files(task_dir)
        self.last_run_s = 0.0  # CPU seconds our threads ran in the last reading's window
        self._last = self._read()

    def _read(self) -> dict[str, tuple[int, int]] | None:
        out = {}
        for tid, text in self._files("schedstat"):
            try:
                run, wait = text.split()[:2]
                out[tid] = (int(run), int(wait))
            except ValueError:
                continue
        return out or None

    @property
    def available(self) -> bool:
        return self._last is not None

    def others_running(self, loadavg: str = "/proc/loadavg") -> int | None:
        """Runnable tasks of other processes on the host right now (the kernel's instantaneous count, less
        this process's runnable threads: the caller, and e.g. a server thread that just handed it work)."""
        try:
            with open(loadavg, "rb") as f:
                total = int(f.read().split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return None
        return max(0, total - self._own_running())

    def _own_running(self) -> int:
        # the state follows the command name, which may hold spaces: after the last ")"
        own = sum(stat[stat.rfind(b")") + 2 :][:1] == b"R" for _, stat in self._files("stat"))
        return max(own, 1)  # the caller is running

    def waiting(self) -> float | None:
        """waiting / (running + waiting) of the threads alive at both readings; None where nothing ran
        (under 1 ms) or the host does not tell."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        run = wait = 0
        for tid, (r, w) in now.items():
            before = last.get(tid)
            if before is not None and r >= before[0] and w >= before[1]:  # (not a new thread on a reused tid)
                run += r - before[0]
                wait += w - before[1]
        total = run + wait
        self.last_run_s = run / 1e9
        return wait / total if total >= 1_000_000 else None


class SpinSwitch:
    """Picks the spinning or the calm session for each step from our threads' CPU wait (module docstring)."""

    def __init__(
        self,
        calm,
        spinning,
        *,
        interval: float = 0.02,
        busy: float = 0.15,
        quiet: float = 0.05,
        busy_windows: int = 3,
        quiet_windows: int = 1,
        settle: float = 0.05,
        load: HostLoad | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.calm, self.spinning = calm, spinning
        self.interval, self.settle = float(interval), float(settle)
        self.busy, self.quiet = float(busy), float(quiet)
        self.busy_windows, self.quiet_windows = int(busy_windows), int(quiet_windows)
        self.load = load if load is not None else ThreadWait()
        self.clock = clock
        self.spinning_now = self.load.available  # a quiet start; the readings correct it
        self.switches = 0
        self.last_waiting: float | None = None
        self._busy = 0
        self._quiet = self.quiet_windows
        self._next = self.clock() + self.interval
        self._settled = 0.0  # readings before this time are dropped (the spinning pool's tail)
        self._recheck = False  # an idle start went calm for another runnable task: ask again next step

    def session(self):
        """The session this step runs on."""
        now = self.clock()
        if now >= self._next:
            gap = now - self._next + self.interval  # since the last reading
            self._next = now + self.interval
            waiting = self.load.waiting()
            # idle: no reading for 4 intervals and our threads hardly ran meanwhile (a long prefill step
            # is no idle time: its end finds our own pool still spinning)
            idle = self.interval > 0 and gap > 4 * self.interval and self.load.last_run_s < 0.25 * gap
            self._recheck = False
            if idle:  # no step for a while: a fresh start (the last window told of back then), spinning
                # unless another task is runnable right now (a competing process; our pools are asleep)
                want = self.load.available and not self.load.others_running()
                self.switches += want != self.spinning_now
                self.spinning_now, self._busy, self._quiet = want, 0, self.quiet_windows
                self._recheck = not want and self.load.available
            elif now >= self._settled:
                self._decide(waiting, now)
        elif self._recheck:  # the step after a calm fresh start: was that task only the request's sender?
            self._recheck = False  # (set only by a calm fresh start: no reading has changed it since)
            if self.load.others_running() == 0:
                self.spinning_now, self.switches = True, self.switches + 1
        return self.spinning if self.spinning_now else self.calm

    def _decide(self, waiting: float | None, now: float = 0.0) -> None:
        self.last_waiting = waiting
        if waiting is None:  # nothing ran (or no reading): keep the state
            if not self.load.available:
                self.spinning_now = False
            return
        if waiting >= (self.busy if self.spinning_now else self.quiet):
            self._busy, self._quiet = self._busy + 1, 0
            want = self.spinning_now and self._busy < self.busy_windows
        else:
            self._busy, self._quiet = 0, self._quiet + 1
            want = self.spinning_now or self._quiet >= self.quiet_windows
        if want != self.spinning_now:
            self.spinning_now = want
            self.switches += 1
            if not want:  # the spinning pool spins on for ~40 ms: our threads queue behind it meanwhile
                self._settled = now + self.settle
