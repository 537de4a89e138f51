"""ONNX Runtime thread spinning that follows the host's load (issue 20; runtime/llm/runners/spin_switch.py).

ThreadWait's arithmetic runs on fake /proc files (waiting / (running + waiting) of the threads seen at both
readings); SpinSwitch, on scripted readings and a fake clock, goes calm after the busy windows, keeps its
state through readings where nothing ran, and spins again after the quiet windows; ORT runners (mapped and
paged layouts) loaded with spinning="auto" hold both sessions, a switch that flips every step gives the same
greedy tokens as one session, and the engine's steps run on the session the readings call for. Nothing here
depends on what else the host runs: the real /proc is only read by one smoke check that accepts any share.
(What the readings are on a quiet or a busy host is measured in benchmarks/README.md, not asserted here.)"""

from __future__ import annotations

import numpy as np
import pytest

from precast.runtime.llm.runners.spin_switch import SpinSwitch, ThreadWait


class _Clock:
    """A monotonic clock the test moves: ``advance(s)`` stands for time.sleep(s) on an unloaded host."""

    def __init__(self, step: float = 0.0):
        self.t, self.step = 1000.0, step

    def __call__(self) -> float:
        self.t += self.step  # step > 0: each read is one later step (every session() call takes a reading)
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class _Proc:
    """Fake /proc/self/task: ``schedstat[tid] = (run_ns, wait_ns)``, ``state[tid] = "R" | "S"``."""

    def __init__(self, schedstat=None, state=None):
        self.schedstat, self.state = dict(schedstat or {}), dict(state or {})

    def __call__(self, name):
        if name == "schedstat":
            return [(tid, f"{r} {w} 17\n".encode()) for tid, (r, w) in self.schedstat.items()]
        # the command name may hold spaces and parentheses: the state follows the last ")"
        return [(tid, f"{tid} (py (x) y) {s} 1 2 3\n".encode()) for tid, s in self.state.items()]


def test_thread_wait_is_the_waiting_share_of_threads_seen_at_both_readings():
    ms = 1_000_000
    proc = _Proc({"10": (5 * ms, 1 * ms), "11": (2 * ms, 0), "12": (9 * ms, 9 * ms)})
    wait = ThreadWait(files=proc)
    assert wait.available
    # 10: ran 6 ms, waited 2 ms; 11: ran 2 ms, waited 0; 12 ended; 13 is new (no window of its own yet)
    proc.schedstat = {"10": (11 * ms, 3 * ms), "11": (4 * ms, 0), "13": (50 * ms, 50 * ms)}
    assert wait.waiting() == pytest.approx(2 / 10)
    assert wait.last_run_s == pytest.approx(0.008)
    proc.schedstat["10"] = (11 * ms + 400_000, 3 * ms + 100_000)  # 0.5 ms in all: nothing ran
    assert wait.waiting() is None
    proc.schedstat["10"] = (12 * ms, 6 * ms)  # the next window starts from the last reading, even a None one
    assert wait.waiting() == pytest.approx(2.9 / (2.9 + 0.6))


def test_thread_wait_skips_malformed_lines_and_reused_thread_ids():
    ms = 1_000_000
    proc = _Proc({"10": (5 * ms, 1 * ms), "11": (90 * ms, 90 * ms)})
    wait = ThreadWait(files=proc)
    proc.schedstat = {"10": (8 * ms, 2 * ms), "11": (1 * ms, 0)}  # 11 ended, a new thread got its id
    assert wait.waiting() == pytest.approx(1 / 4)
    wait = ThreadWait(files=lambda name: [("10", b"garbage\n"), ("11", b"")])
    assert not wait.available and wait.waiting() is None


def test_thread_wait_without_schedstat_reads_nothing(tmp_path):
    wait = ThreadWait(str(tmp_path / "missing"))
    assert not wait.available and wait.waiting() is None


def test_own_runnable_threads_are_not_other_processes(tmp_path):
    """/proc/loadavg counts every runnable task on the host; our own runnable threads are taken off."""
    proc = _Proc({"10": (0, 0)}, state={"10": "R", "11": "R", "12": "S"})
    wait = ThreadWait(files=proc)
    host = tmp_path / "loadavg"
    host.write_text("0.50 0.40 0.30 5/200 12345\n")
    assert wait.others_running(str(host)) == 3  # 5 runnable, 2 of them ours
    host.write_text("0.50 0.40 0.30 1/200 12345\n")
    assert wait.others_running(str(host)) == 0
    proc.state = {"10": "S"}  # the caller counts as running even where its file says otherwise
    assert wait.others_running(str(host)) == 0
    host.write_text("0.50 0.40 0.30 2/200 12345\n")
    assert wait.others_running(str(host)) == 1
    host.write_text("garbage\n")
    assert wait.others_running(str(host)) is None


def test_thread_wait_on_this_host_reads_a_share_or_nothing():
    """The one reading of the real /proc: any host load gives a share in [0, 1] (None: nothing ran, not Linux)."""
    wait = ThreadWait()
    sum(i * i for i in range(300_000))  # a few ms of our own CPU time
    share = wait.waiting()
    assert share is None or 0.0 <= share <= 1.0
    assert wait.last_run_s >= 0.0


class _Readings:
    last_run_s = 0.0

    def __init__(self, values, running=0):
        self.values, self.available, self.running = list(values), True, running

    def waiting(self):
        return self.values.pop(0)

    def others_running(self):
        return self.running


def test_switch_goes_calm_after_busy_windows_in_a_row_and_spins_again_when_quiet():
    load = _Readings([0.0, 0.4, 0.02, 0.4, 0.3, 0.2, 0.3, None, 0.02, 0.01, 0.5])
    sw = SpinSwitch(
        "calm", "spin", interval=0.0, busy=0.15, busy_windows=3, quiet_windows=1, settle=0.0, load=load
    )
    picks = [sw.session() for _ in range(11)]
    # one busy reading (another process's 40 ms tail) keeps spinning; three in a row go calm; a reading
    # where nothing ran (None) keeps the state
    assert picks == ["spin", "spin", "spin", "spin", "spin", "calm", "calm", "calm", "spin", "spin", "spin"]
    assert sw.switches == 2


def test_readings_where_nothing_ran_keep_either_state():
    load = _Readings([None, None, 0.4, None, None, 0.0, None])
    sw = SpinSwitch("calm", "spin", interval=0.0, busy_windows=1, settle=0.0, load=load)
    assert [sw.session() for _ in range(7)] == ["spin", "spin", "calm", "calm", "calm", "spin", "spin"]
    assert sw.switches == 2 and sw.last_waiting is None


def test_readings_right_after_going_calm_are_dropped():
    """Our own spinning pool spins on ~40 ms after the switch: its queueing must not keep the switch calm."""
    clock = _Clock()
    load = _Readings([0.4, 0.4, 0.0])
    sw = SpinSwitch("calm", "spin", interval=0.0, busy_windows=1, settle=0.2, load=load, clock=clock)
    assert sw.session() == "calm"
    clock.advance(0.1)
    assert sw.session() == "calm"  # 0.4 dropped (settling) ...
    clock.advance(0.15)
    assert sw.session() == "spin"  # ... the reading after it decides (0.0)
    assert sw.last_waiting == 0.0


def test_after_idle_time_a_burst_starts_spinning():
    clock = _Clock()
    load = _Readings([0.4, 0.4, 0.0, 0.4])
    sw = SpinSwitch("calm", "spin", interval=0.1, busy_windows=1, settle=0.0, load=load, clock=clock)
    clock.advance(0.12)
    assert sw.session() == "calm"  # a recent busy window
    clock.advance(0.6)  # idle: > 4 intervals
    assert sw.session() == "spin"  # a fresh start (that window's 0.4 told of back then)
    clock.advance(0.12)
    assert sw.session() == "spin"  # its own first window was quiet
    clock.advance(0.12)
    assert sw.session() == "calm"
    assert load.values == []
    load.values, load.running = [0.0], 1
    clock.advance(0.6)
    assert sw.session() == "calm"  # a fresh start while another process is runnable: calm at once


class _Senders(_Readings):
    """others_running: one runnable task at the first ask (the request's sender), then ``after``."""

    def __init__(self, values, after):
        super().__init__(values, running=1)
        self.after, self.asked = after, 0

    def others_running(self):
        self.asked += 1
        return self.running if self.asked == 1 else self.after


@pytest.mark.parametrize("after, want", [(0, "spin"), (1, "calm")])
def test_a_calm_fresh_start_asks_again_at_the_next_step(after, want):
    """The task runnable when a burst starts may be the request's sender (gone a step later: spin) or a
    competing process (still there: stay calm); the next step asks again, not the first 20 ms reading."""
    clock = _Clock()
    load = _Senders([0.0], after)
    sw = SpinSwitch("calm", "spin", interval=0.05, busy_windows=3, settle=0.0, load=load, clock=clock)
    clock.advance(0.3)  # idle: > 4 intervals
    assert sw.session() == "calm"  # the fresh start saw a runnable task
    clock.advance(0.001)
    assert sw.session() == want  # the next step (no reading due yet) asks once more
    clock.advance(0.001)
    assert sw.session() == want and load.asked == 2  # once only
    assert sw.switches == 1 + (want == "spin")


def test_a_long_step_is_not_idle_time():
    """A 100 ms prefill step between readings: our threads ran, so the reading decides (no fresh start)."""
    clock = _Clock()
    load = _Readings([0.4, 0.4, 0.4, 0.4], running=0)
    load.last_run_s = 0.2
    sw = SpinSwitch("calm", "spin", interval=0.02, busy_windows=3, settle=0.0, load=load, clock=clock)
    picks = []
    for _ in range(4):
        clock.advance(0.1)
        picks.append(sw.session())
    assert picks == ["spin", "spin", "calm", "calm"]


def test_switch_without_schedstat_stays_calm(tmp_path):
    sw = SpinSwitch("calm", "spin", interval=0.0, load=ThreadWait(str(tmp_path / "missing")))
    assert [sw.session() for _ in range(3)] == ["calm"] * 3


class _Flip:
    """A load that reads busy and quiet in turn: the switch changes session every step."""

    available, running, last_run_s = True, 0, 0.0

    def others_running(self):
        return 0

    def __init__(self):
        self.n = 0

    def waiting(self):
        self.n += 1
        return 1.0 if self.n % 2 else 0.0


@pytest.fixture(scope="module")
def paged_artifact(compiled, tiny_llama_dir):
    return compiled(tiny_llama_dir, targets=("ort-cpu",), task="causal-lm", kv_layout="paged").output


def _greedy(engine, prompts, n=24):
    from precast.runtime.llm.sampler import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("layout", ["mapped", "paged"])
def test_flipping_sessions_every_step_keeps_greedy_tokens(layout, llm_artifact, paged_artifact):
    from precast.runtime.llm import Engine

    art = llm_artifact if layout == "mapped" else paged_artifact
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 40, 70, 12)]
    calm = Engine.load(art, num_blocks=32, threads=2, spinning=False)
    assert calm.runner.spin_switch is None
    ref = _greedy(calm, prompts) + _greedy(calm, prompts[:1])
    auto = Engine.load(art, num_blocks=32, threads=2)  # spinning="auto" is the default
    sw = auto.runner.spin_switch
    assert sw is not None and sw.spinning is not sw.calm
    sw = auto.runner.spin_switch = SpinSwitch(
        sw.calm, sw.spinning, interval=0.0, busy_windows=1, quiet_windows=1, settle=0.0, load=_Flip()
    )
    got = _greedy(auto, prompts) + _greedy(auto, prompts[:1])  # batched, then batch-1 steady decode
    assert got == ref
    assert sw.switches >= 20  # both sessions ran steps


class _Phase:
    """A load whose every reading is ``value`` (the test sets it: busy, nothing ran, quiet)."""

    available, last_run_s = True, 0.0

    def __init__(self):
        self.value, self.readings = 0.0, 0

    def waiting(self):
        self.readings += 1
        return self.value

    def others_running(self):
        return 0


class _Recorded(SpinSwitch):
    """A SpinSwitch that keeps each session it handed out."""

    picks: list

    def session(self):
        self.picks.append(super().session())
        return self.picks[-1]


def test_engine_runs_calm_on_busy_readings_and_spins_again_on_quiet_ones(llm_artifact):
    from precast.runtime.llm import Engine

    engine = Engine.load(llm_artifact, num_blocks=32, threads=2)
    real = engine.runner.spin_switch
    assert real.interval == 0.02 and isinstance(real.load, ThreadWait)
    assert real.spinning_now == real.load.available  # a quiet start
    load = _Phase()
    # one interval per step: every step takes a reading (the engine's steps, not the host's time)
    sw = engine.runner.spin_switch = _Recorded(real.calm, real.spinning, load=load, clock=_Clock(step=0.025))
    sw.picks = []
    calm, spin = sw.calm, sw.spinning
    prompts = [list(range(1, 20)), list(range(3, 9))]  # two rows: a reading at every decode step

    load.value = 0.4  # every core busy with another process
    busy = _greedy(engine, prompts, 16)
    assert load.readings >= 5 and sw.picks[:2] == [spin, spin] and set(sw.picks[2:]) == {calm}
    assert not sw.spinning_now and sw.switches == 1

    sw.picks, load.value = [], None  # readings where nothing ran: the state stays
    assert _greedy(engine, prompts, 16) == busy
    assert set(sw.picks) == {calm} and sw.switches == 1

    sw.picks, load.value = [], 0.0  # quiet again: the first reading spins
    assert _greedy(engine, prompts, 16) == busy
    assert set(sw.picks) == {spin} and sw.spinning_now and sw.switches == 2


def test_spinning_value_is_checked(llm_artifact):
    from precast.errors import UsageError
    from precast.runtime.llm.runners.gather import ModelRunner

    with pytest.raises(UsageError, match="spinning must be True, False or 'auto'"):
        ModelRunner.from_artifact(llm_artifact, spinning="yes")
