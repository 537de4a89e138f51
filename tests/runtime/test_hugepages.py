"""Weights on transparent huge pages after a load (runtime/hugepages.py)."""

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from precast.runtime import hugepages

MB = 1 << 20


def _private(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (malloc's kind of memory)


def _thp_usable() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def test_subtract_keeps_only_new_address_ranges():
    old = [(100, 200), (300, 400)]
    new = [(0, 50), (100, 250), (280, 420), (500, 600)]
    assert hugepages._subtract(new, old) == [(0, 50), (200, 250), (280, 300), (400, 420), (500, 600)]
    assert hugepages._subtract([(100, 200)], old) == []


def test_disabled_by_env_or_setting(monkeypatch):
    monkeypatch.setenv("PRECAST_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    monkeypatch.delenv("PRECAST_HUGE_PAGES")
    assert not hugepages.enabled({"huge_pages": False})
    report: dict = {}
    with hugepages.collapse_new_memory({"huge_pages": False}, report):
        buf = _private(16 * MB)
    buf.close()
    assert report == {}


@pytest.mark.skipif(not _thp_usable(), reason="needs Linux with transparent huge pages not 'never'")
def test_memory_allocated_inside_is_advised_and_collapsed():
    report: dict = {}
    before = hugepages.huge_page_bytes()
    with hugepages.collapse_new_memory(None, report):
        buf = _private(32 * MB)  # anonymous, 4 KiB pages, touched below (as loaded weights are)
        buf.write(b"\1" * (32 * MB))
    try:
        assert report["advised"] >= 28 * MB  # the 2 MiB-aligned part of the new range
        # MADV_COLLAPSE needs Linux 6.1+ (MADV_HUGEPAGE alone still helps pages faulted later)
        if report["collapsed"]:
            assert hugepages.huge_page_bytes() - before >= 16 * MB
        assert buf[:4] == b"\1\1\1\1" and buf[-1:] == b"\1"  # contents unchanged
    finally:
        buf.close()


_LOAD = """
import sys
from pathlib import Path
import numpy as np
from precast.runtime import hugepages
from precast.runtime.backends import create_session
from precast.artifact.target_blocks import OrtBlock
root = Path(sys.argv[1])
before = hugepages.huge_page_bytes()
session = create_session(root, OrtBlock(name="ort-cpu", model="model.onnx"), 1)
grew = hugepages.huge_page_bytes() - before
x = np.load(root / "x.npy")
np.save(root / "y.npy", session.run(None, {"x": x})[0])
print(grew)
"""


@pytest.mark.skipif(not _thp_usable(), reason="needs Linux with transparent huge pages not 'never'")
def test_an_onnxruntime_session_gets_its_weights_on_huge_pages(tmp_path):
    # In a fresh process, as a server or CLI loads its model. (In a long-lived process the weights can land
    # in memory malloc had before the load, which is left as it is: see runtime/hugepages.py.)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2048, 2048), dtype=np.float32)  # 16 MB: well past the 8 MB floor
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2048])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "model.onnx")
    x = rng.standard_normal((1, 2048), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(out.stdout.strip().splitlines()[-1]) >= 8 * MB, out.stdout
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), x @ w, rtol=1e-4, atol=1e-3)
