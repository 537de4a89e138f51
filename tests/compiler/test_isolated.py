"""compiler/isolated: a step run in a child process returns its dict, its typed error, or a crash error."""

import os
from pathlib import Path

import pytest

from precast.errors import NativeCrashError, UsageError
from precast.targets import isolated
from precast.targets.isolated import run_isolated

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def entry(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

    def use(func: str) -> str:
        monkeypatch.setitem(isolated.ENTRIES, "test", f"tests.targets.crash_entries:{func}")
        return "test"

    return use


def test_result_comes_back_and_stdout_noise_goes_to_stderr(entry):
    child = run_isolated(entry("echo"), {"a": [1, 2]}, what="step", timeout=60)
    assert child.value == {"echo": {"a": [1, 2]}}
    assert "native code printing to stdout" in child.stderr_tail


def test_typed_error_keeps_its_type(entry):
    with pytest.raises(UsageError, match="^entry refused: bad payload$"):
        run_isolated(entry("refuse"), {}, what="step", timeout=60)


def test_bug_in_entry_is_internal_with_traceback(entry):
    with pytest.raises(RuntimeError, match="KeyError: 'missing'") as info:
        run_isolated(entry("bug"), {}, what="step", timeout=60)
    assert not isinstance(info.value, NativeCrashError) and "Traceback" in str(info.value)


def test_segfault_is_native_crash_with_python_stack(entry):
    with pytest.raises(NativeCrashError, match=r"^step crashed \(SIGSEGV\)$") as info:
        run_isolated(entry("segfault"), {}, what="step", timeout=60)
    assert info.value.exit_code == 5 and info.value.signal == "SIGSEGV"
    assert "Fatal Python error: Segmentation fault" in info.value.stderr_tail  # faulthandler's stack


def test_working_directory_cannot_shadow_modules(entry, tmp_path, monkeypatch):
    (tmp_path / "json.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    assert run_isolated(entry("echo"), {}, what="step", timeout=60).value == {"echo": {}}


def test_unknown_entry_name_is_refused_before_any_child():
    with pytest.raises(KeyError):
        run_isolated("tests.targets.crash_entries:segfault", {}, what="step", timeout=60)
