"""ONNX Runtime thread spinning that follows the host's load (issue 20; runtime/llm/spin_switch.py).

ThreadWait reads our threads' run-queue delay: a spinning decode waits for CPU when every core has a
competing process, not on a quiet host; SpinSwitch goes calm at the first busy reading, keeps its state
through readings where nothing ran, and spins again after the quiet windows; ORT runners (mapped and paged
layouts) loaded with spinning="auto" hold both sessions, and a switch that flips every step gives the same
greedy tokens as one session; under real competing processes the engine runs on the calm session, and back
on the spinning one once the host is quiet again."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from precast.runtime.llm.spin_switch import SpinSwitch, ThreadWait

BURN = "import time\nt = time.time()\nwhile time.time() - t < 60:\n    pass"


class _Burners:
    """One busy process per core (so our threads must queue for a CPU)."""

    def __enter__(self):
        self.ps = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(os.cpu_count() or 2)]
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        for p in self.ps:
            p.kill()
            p.wait()


def _decode_for(engine, seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        _greedy(engine, [list(range(1, 20))], 16)


def test_thread_wait_reads_queueing_under_competing_processes_only(llama_artifact_mapped):
    from precast.runtime.llm import Engine

    engine = Engine.load(llama_artifact_mapped, num_blocks=32, threads=2, spinning=True)
    wait = ThreadWait()
    _decode_for(engine, 0.6)
    quiet = wait.waiting()
    with _Burners():
        wait.waiting()
        _decode_for(engine, 0.6)
        busy = wait.waiting()
    assert quiet is not None and busy is not None
    assert quiet < 0.1, f"a quiet host read as {quiet:.3f} of our runnable time waiting"
    assert busy >= 0.15, f"a busy process per core read as only {busy:.3f} waiting"


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
    # one busy reading (another process's 40 ms tail) keeps spinning; three in a row go calm
    assert picks == ["spin", "spin", "spin", "spin", "spin", "calm", "calm", "calm", "spin", "spin", "spin"]
    assert sw.switches == 2


def test_readings_right_after_going_calm_are_dropped():
    """Our own spinning pool spins on ~40 ms after the switch: its queueing must not keep the switch calm."""
    load = _Readings([0.4, 0.4, 0.0])
    sw = SpinSwitch("calm", "spin", interval=0.0, busy_windows=1, settle=0.2, load=load)
    assert sw.session() == "calm"
    assert sw.session() == "calm"  # 0.4 dropped (settling) ...
    time.sleep(0.25)
    assert sw.session() == "spin"  # ... the reading after it decides (0.0)
    assert sw.last_waiting == 0.0


def test_after_idle_time_a_burst_starts_spinning():
    load = _Readings([0.4, 0.4, 0.0, 0.4])
    sw = SpinSwitch("calm", "spin", interval=0.1, busy_windows=1, settle=0.0, load=load)
    time.sleep(0.12)
    assert sw.session() == "calm"  # a recent busy window
    time.sleep(0.6)  # idle: > 4 intervals
    assert sw.session() == "spin"  # a fresh start (that window's 0.4 told of back then)
    time.sleep(0.12)
    assert sw.session() == "spin"  # its own first window was quiet
    time.sleep(0.12)
    assert sw.session() == "calm"
    assert load.values == []
    load.values, load.running = [0.0], 1
    time.sleep(0.6)
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
    load = _Senders([0.0], after)
    sw = SpinSwitch("calm", "spin", interval=0.05, busy_windows=3, settle=0.0, load=load)
    time.sleep(0.3)  # idle: > 4 intervals
    assert sw.session() == "calm"  # the fresh start saw a runnable task
    assert sw.session() == want  # the next step (no reading due yet) asks once more
    assert sw.session() == want and load.asked == 2  # once only
    assert sw.switches == 1 + (want == "spin")


def test_own_runnable_threads_are_not_other_processes(tmp_path):
    """/proc/loadavg counts every runnable task on the host; our own runnable threads are taken off."""
    wait = ThreadWait()
    host = tmp_path / "loadavg"
    host.write_text("0.50 0.40 0.30 3/200 12345\n")
    own = wait._own_running()
    assert own >= 1
    assert wait.others_running(str(host)) == max(0, 3 - own)
    host.write_text("0.50 0.40 0.30 1/200 12345\n")
    assert wait.others_running(str(host)) == 0


def test_a_long_step_is_not_idle_time():
    """A 100 ms prefill step between readings: our threads ran, so the reading decides (no fresh start)."""
    load = _Readings([0.4, 0.4, 0.4, 0.4], running=0)
    load.last_run_s = 0.2
    sw = SpinSwitch("calm", "spin", interval=0.02, busy_windows=3, settle=0.0, load=load)
    picks = []
    for _ in range(4):
        time.sleep(0.1)
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
def paged_artifact(tiny_llama_dir, tmp_path_factory):
    from precast.compiler.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("art") / "llama-paged"
    opts = CompileOptions(targets=("ort-cpu",), task="causal-lm", kv_layout="paged")
    return compile_model(str(tiny_llama_dir), out, opts).output


def _greedy(engine, prompts, n=24):
    from precast.runtime.llm.sampler import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("layout", ["mapped", "paged"])
def test_flipping_sessions_every_step_keeps_greedy_tokens(layout, llama_artifact_mapped, paged_artifact):
    from precast.runtime.llm import Engine

    art = llama_artifact_mapped if layout == "mapped" else paged_artifact
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


def test_engine_runs_calm_under_competing_processes_and_spins_when_quiet(llama_artifact_mapped):
    from precast.runtime.llm import Engine

    engine = Engine.load(llama_artifact_mapped, num_blocks=32, threads=2)
    assert engine.runner.spin_switch.interval == 0.02 and engine.runner.spin_switch.spinning_now
    with _Burners():
        _decode_for(engine, 1.0)
        sw = engine.runner.spin_switch
        assert not sw.spinning_now, f"our threads read {sw.last_waiting} waiting"
    _decode_for(engine, 1.0)
    assert sw.spinning_now, f"quiet host, our threads read {sw.last_waiting} waiting"
    assert sw.switches >= 2


def test_spinning_value_is_checked(llama_artifact_mapped):
    from precast.runtime.errors import UsageError
    from precast.runtime.llm.model_runner import ModelRunner

    with pytest.raises(UsageError, match="spinning must be True, False or 'auto'"):
        ModelRunner.from_artifact(llama_artifact_mapped, spinning="yes")
