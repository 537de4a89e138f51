"""ONNX Runtime's thread spinning that follows the host's load: two sessions, one picked per step.

ONNX Runtime's intra-op threads either spin-wait for the next parallel section (its default) or sleep. On
a quiet host spinning wins the wake-up latency back (a decode step of a small model is 1-3 ms, and waking a
sleeping thread costs tens of microseconds several times a step): measured 1.3-1.5x decode tokens/s at
batch 1 on bench_llm.py's models. Under a competing process it loses the time slices the step's own
threads need: 1.6x slower with one core busy (benchmarks/README.md). The setting is fixed when a session
is created, so a runner with ``spinning="auto"`` holds both and asks ``SpinSwitch.session()`` each step:

    the spinning session while other processes used < ``busy`` cores over the last ``interval`` seconds,
    the calm (sleeping) one otherwise; back to spinning only after ``quiet_windows`` quiet readings.
    After idle time (no step for 4 intervals) the old window says nothing of now: spin, and decide on a
    fresh window.

"Other processes" = the host's busy CPU time (/proc/stat: user, nice, system, irq, softirq, steal) minus
this process's own (os.times(): every thread, a spinning one included), so our own spinning never reads as
load. Reading costs ~20 us and happens once per interval; a step otherwise pays one clock read.
Where /proc/stat cannot be read (not Linux) the switch stays calm.
"""

from __future__ import annotations

import os
import time

__all__ = ["HostLoad", "SpinSwitch"]


class HostLoad:
    """CPU cores that other processes used since the previous reading (``others()``)."""

    def __init__(self, stat_path: str = "/proc/stat"):
        self.stat_path = stat_path
        self._tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open(self.stat_path, "rb") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 5 or fields[0] != b"cpu":
            return None
        v = [int(x) for x in fields[1:9]] + [0] * (9 - len(fields))
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
        t = os.times()
        return time.monotonic(), busy / self._tick, t.user + t.system

    @property
    def available(self) -> bool:
        return self._last is not None

    def others(self) -> float | None:
        """Cores busy with other processes since the last call (None where the host does not tell)."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))


class SpinSwitch:
    """Picks the spinning or the calm session for each step from the host's load (module docstring)."""

    def __init__(
        self,
        calm,
        spinning,
        *,
        interval: float = 0.25,
        busy: float = 0.3,
        quiet_windows: int = 2,
        load: HostLoad | None = None,
    ):
        self.calm, self.spinning = calm, spinning
        self.interval, self.busy, self.quiet_windows = float(interval), float(busy), int(quiet_windows)
        self.load = load if load is not None else HostLoad()
        self.spinning_now = self.load.available  # a quiet start; the first reading corrects it
        self.switches = 0
        self.last_others: float | None = None
        self._quiet = 0
        self._read_at = time.monotonic()
        self._next = self._read_at + self.interval

    def session(self):
        """The session this step runs on."""
        now = time.monotonic()
        if now >= self._next:
            if self.interval > 0 and now - self._read_at > 4 * self.interval:  # after idle time: that window says nothing of now
                self._restart(now)
            else:
                self._decide(now)
        return self.spinning if self.spinning_now else self.calm

    def _restart(self, now: float) -> None:
        """A fresh window, spinning until it says otherwise (the old window held others' past work; a
        shorter one would not do: /proc/stat and os.times() count in 10 ms ticks, so a 60 ms window reads
        one or two ticks of jitter as 0.2-0.3 cores)."""
        self.load.others()  # (a new baseline)
        self._read_at, self._next = now, now + self.interval
        self.spinning_now = self.load.available
        self._quiet = self.quiet_windows

    def _decide(self, now: float) -> None:
        others = self.load.others()
        self.last_others = others
        self._read_at, self._next = now, now + self.interval
        if others is None or others >= self.busy:
            self._quiet = 0
            want = False
        else:
            self._quiet += 1
            want = self.spinning_now or self._quiet >= self.quiet_windows
        if want != self.spinning_now:
            self.spinning_now = want
            self.switches += 1
