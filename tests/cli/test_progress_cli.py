"""Progress on stderr (plain lines off a terminal, a live line on one), silent with -q and --json; the size line;
the exit right after "wrote ..." (no multi-second interpreter shutdown)."""

import io
import json
import re
import subprocess
import sys
import textwrap
import time

import pytest
from rich.console import Console

from precast.cli.output import Progress, format_bytes
from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.frontends.source import parse_input_spec
from precast.ir.pipeline import parse_pipeline
from precast.targets.ort_cpu import OrtCpu
from tests.fake_progress import RecordingProgress
from tests.helpers import save, tiny_mlp


@pytest.fixture
def mlp_path(tmp_path):
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def _size(root):
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


_NET = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def build():
    return Net()
"""
# transformers' modules loaded as well: the object count of a Hugging Face compile, which the shutdown GC walked
_NET_WITH_TRANSFORMERS = (
    "import transformers\nfrom transformers import LlamaForCausalLM  # noqa: F401\n" + _NET
)


def test_compile_progress_on_stderr_ends_with_the_size(cli, mlp_path, tmp_path):
    out = tmp_path / "art"
    r = cli("compile", mlp_path, "-o", out, "--report", tmp_path / "r.json")
    assert r.code == 0, r.err
    assert r.out == ""
    assert "• [ort-cpu] fold-constants: folded=" in r.err  # a line per pass
    size, count = _size(out)
    last = r.err.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out} ({format_bytes(size)}, {count} files) in "), last
    assert "\x1b[" not in r.err  # not a terminal: plain lines, no ANSI
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["artifact"] == {"path": str(out), "bytes": size, "files": count}


def test_quiet_and_json_print_no_progress(cli, mlp_path, tmp_path):
    r = cli("compile", mlp_path, "-o", tmp_path / "q", "-q")
    assert r.code == 0 and r.err == "" and r.out == ""
    r = cli("compile", mlp_path, "-o", tmp_path / "j", "--json")
    assert r.code == 0 and r.err == ""
    doc = json.loads(r.out)  # stdout is JSON only
    size, count = _size(tmp_path / "j")
    assert doc["artifact"] == {"path": str(tmp_path / "j"), "bytes": size, "files": count}
    assert doc["schema_version"] == 1 and doc["target"]["name"] == "ort-cpu"


def test_compile_reports_each_step_and_pass(mlp_path, tmp_path):
    rec = RecordingProgress()
    result = compile_model(str(mlp_path), tmp_path / "art", CompileOptions(), progress=rec)
    passes = [f"[ort-cpu] {s}" for s in parse_pipeline(OrtCpu.default_pipeline)]
    assert rec.steps == [
        f"loading {mlp_path}",
        "running the reference (onnxruntime (unoptimized source graph))",
        *passes,
        "[ort-cpu] building",
        "[ort-cpu] verifying against onnxruntime (unoptimized source graph)",
    ]
    assert [n.split(":")[0] for n in rec.notes] == passes  # each pass's stats
    assert (result.bytes, result.files) == _size(tmp_path / "art")


def test_torch_export_is_a_step(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "tinynet.py").write_text(_NET)
    monkeypatch.chdir(tmp_path)
    rec = RecordingProgress()
    opts = CompileOptions(inputs=[parse_input_spec("x:float32[batch,8]")])
    compile_model("tinynet:build", tmp_path / "art", opts, progress=rec)
    assert rec.steps[:4] == [
        "loading tinynet:build",
        "importing torch",
        "exporting Net with torch.export (dynamo)",
        "running the reference (torch (eager))",
    ]


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 1000, 87_612_345, 999_960, 2 * 10**12)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "87.6 MB",
        "1.0 MB",
        "2.0 TB",
    ]


def test_plain_lines_quick_steps_speak_through_their_notes():
    buf = io.StringIO()
    p = Progress(console=Console(file=buf, width=200), plain_after=60, plain_every=0)
    with p:
        p.step("[ort-cpu] fold-constants")
        p.note("[ort-cpu] fold-constants: folded=2 (3 ms)")
        p.step("[ort-cpu] quantize-int4{algo=gptq}")
        p.advance(1, 3, "MatMul 'fc1' (1 of 3)")  # a step that reports is shown before its progress
    lines = buf.getvalue().splitlines()
    assert lines[0] == "• [ort-cpu] fold-constants: folded=2 (3 ms)"
    assert lines[1].startswith("• [ort-cpu] quantize-int4{algo=gptq} (at ")
    assert lines[2] == "  1/3 MatMul 'fc1' (1 of 3)" and len(lines) == 3
    assert "\x1b" not in buf.getvalue()


def test_plain_line_for_a_step_that_runs_long():
    buf = io.StringIO()
    # plain_after long enough that the quick step surely ends first on a busy host; the slow one's line is
    # awaited, not slept for
    with Progress(console=Console(file=buf, width=200), plain_after=1.0) as p:
        p.step("exporting Net with torch.export (dynamo)")
        deadline = time.monotonic() + 30
        while not buf.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        p.step("running the reference")  # ends at once: no line
    (line,) = buf.getvalue().splitlines()
    assert re.fullmatch(r"• exporting Net with torch\.export \(dynamo\) \(at \d+\.\ds\)", line), line


def test_live_line_on_a_terminal_and_silence_when_quiet():
    buf = io.StringIO()
    term = Console(file=buf, width=120, force_terminal=True, force_interactive=True, highlight=False)
    with Progress(console=term) as p:
        p.step("[ort-cpu] quantize-int4{algo=gptq}")
        p.advance(2, 4, "MatMul 'fc2' (2 of 4)")
        p.note("[ort-cpu] quantize-int4: quantized=4")
        assert p._live is not None
    assert p._live is None  # stopped: an error message after it prints on a clean line
    text = buf.getvalue()
    assert "quantize-int4: quantized=4" in text and "2/4" in text and "\x1b[" in text
    buf = io.StringIO()
    with Progress(quiet=True, console=Console(file=buf, force_terminal=True, force_interactive=True)) as p:
        p.step("x")
        p.advance(1, 2, "y")
        p.note("z")
        p("older API")
    assert buf.getvalue() == ""


def test_gc_is_frozen_by_the_last_exit_handler(tmp_path):
    """The mechanism of the fast exit: only the process's own command line freezes the collector, and only after
    every other exit handler (temp-dir cleanup) ran."""
    code = textwrap.dedent(
        """
        import atexit, gc, sys
        atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))  # runs after main's
        from precast.cli.main import main
        main()
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "passes", "--json"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("frozen True"), r.stderr
    code = code.replace("main()", "main(['passes', '--json'])")  # main(argv) from a caller: no freeze
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("frozen False"), r.stderr


def test_torch_compile_exits_right_after_wrote(tmp_path):
    """Measured on a tiny module with transformers loaded: 1.4-1.7 s from "wrote" to exit before, 0.2 s after."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "tinynet.py").write_text(_NET_WITH_TRANSFORMERS)
    cmd = [sys.executable, "-m", "precast", "compile", "tinynet:build", "-i", "x:float32[batch,8]"]
    p = subprocess.Popen(
        [*cmd, "-o", str(tmp_path / "art")],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wrote = None
    for line in p.stderr:
        if line.startswith("wrote "):
            wrote = time.monotonic()
    p.wait(timeout=300)
    end = time.monotonic()
    assert p.returncode == 0 and wrote is not None
    assert end - wrote < 1.0, f"{end - wrote:.2f}s from 'wrote' to exit"
