"""ONNX Runtime thread spinning that follows the host's load (issue 20; runtime/llm/spin_switch.py).

HostLoad counts other processes' CPU and not this one's (a burner process reads as ~1 core, our own busy
loop as ~0); SpinSwitch goes calm at the first busy reading and back to spinning after the quiet windows;
ORT runners (mapped and paged layouts) loaded with spinning="auto" hold both sessions, and a switch that
flips every step gives the same greedy tokens as one session; under a real competing process the engine
runs on the calm session, and back on the spinning one once the host is quiet again."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from precast.runtime.llm.spin_switch import HostLoad, SpinSwitch

BURN = "import time\nt = time.time()\nwhile time.time() - t < 30:\n    pass"


@pytest.fixture
def burner():
    p = subprocess.Popen([sys.executable, "-c", BURN])
    time.sleep(0.3)
    yield p
    p.kill()
    p.wait()


def test_host_load_counts_other_processes_not_this_one(burner):
    load = HostLoad()
    time.sleep(0.6)
    busy = load.others()
    burner.kill()
    burner.wait()
    load.others()
    t = time.monotonic()
    while time.monotonic() - t < 0.6:  # this process busy: not "others"
        pass
    own = load.others()
    assert busy is not None and own is not None
    assert busy >= 0.6, f"a burner process read as {busy:.2f} cores"
    assert own < 0.4, f"this process's own loop read as {own:.2f} cores of others"


class _Readings:
    def __init__(self, values):
        self.values, self.available = list(values), True

    def others(self):
        return self.values.pop(0)


def test_switch_goes_calm_at_once_and_spins_again_after_quiet_windows():
    load = _Readings([0.0, 0.9, 0.1, 0.1, 0.1, 0.5, None])
    sw = SpinSwitch("calm", "spin", interval=0.0, busy=0.3, quiet_windows=2, load=load)
    picks = [sw.session() for _ in range(7)]
    assert picks == ["spin", "calm", "calm", "spin", "spin", "calm", "calm"]
    assert sw.switches == 3


def test_after_idle_time_the_switch_spins_and_decides_on_a_fresh_short_window():
    """The window since the last step held other processes' past work (in bench_llm.py, the other engines'
    requests): it is dropped, the switch spins at once and decides again on a fresh window."""
    load = _Readings([None, 0.9, 0.0, 0.9])  # (None: the restart's fresh baseline)
    sw = SpinSwitch("calm", "spin", interval=0.04, busy=0.3, quiet_windows=2, load=load)
    time.sleep(0.05)
    assert sw.session() == "calm"  # reading 0.9 (a recent window)
    time.sleep(0.2)  # idle: > 4 intervals
    assert sw.session() == "spin"  # restarted: a new baseline, spinning
    time.sleep(0.045)
    assert sw.session() == "spin"  # the fresh window read quiet (0.0)
    time.sleep(0.045)
    assert sw.session() == "calm"  # busy again


def test_switch_without_proc_stat_stays_calm(tmp_path):
    sw = SpinSwitch("calm", "spin", interval=0.0, load=HostLoad(str(tmp_path / "missing")))
    assert [sw.session() for _ in range(3)] == ["calm"] * 3


class _Flip:
    """A load that reads busy and quiet in turn: the switch changes session every step."""

    available = True

    def __init__(self):
        self.n = 0

    def others(self):
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
    sw = auto.runner.spin_switch = SpinSwitch(sw.calm, sw.spinning, interval=0.0, quiet_windows=1, load=_Flip())
    got = _greedy(auto, prompts) + _greedy(auto, prompts[:1])  # batched, then batch-1 steady decode
    assert got == ref
    assert sw.switches >= 20  # both sessions ran steps


def test_engine_runs_calm_under_a_competing_process_and_spins_when_quiet(llama_artifact_mapped):
    from precast.runtime.llm import Engine

    engine = Engine.load(llama_artifact_mapped, num_blocks=32, threads=2)
    sw = engine.runner.spin_switch
    sw = engine.runner.spin_switch = SpinSwitch(sw.calm, sw.spinning, interval=0.05)
    prompt = list(range(1, 20))
    p = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        time.sleep(0.3)
        t = time.monotonic()
        while time.monotonic() - t < 1.0:
            _greedy(engine, [prompt], 16)
        assert not sw.spinning_now, f"others read {sw.last_others} cores"
    finally:
        p.kill()
        p.wait()
    t = time.monotonic()
    while time.monotonic() - t < 1.0:
        _greedy(engine, [prompt], 16)
    assert sw.spinning_now, f"quiet host, others read {sw.last_others} cores"


def test_spinning_value_is_checked(llama_artifact_mapped):
    from precast.runtime.errors import UsageError
    from precast.runtime.llm.model_runner import ModelRunner

    with pytest.raises(UsageError, match="spinning must be True, False or 'auto'"):
        ModelRunner.from_artifact(llama_artifact_mapped, spinning="yes")
