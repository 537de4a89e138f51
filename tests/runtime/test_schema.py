"""The typed artifact schema: manifests as schema-1 compilers write them load and come back byte for byte;
an unknown, missing or mistyped key is exit 3 naming the file, the block and the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import Manifest, dump_json, read_manifest, sha256_file
from precast.artifact.schema import IOSignature, TargetEntry, TensorSpec
from precast.artifact.target_blocks import (
    EPPlugin,
    IndexTargetBlock,
    OpenVINOBlock,
    OrtBlock,
    QnnBlock,
    SessionSettings,
    TargetBlock,
    TensorRTBlock,
    TritonBlock,
    target_block_from_json,
)
from precast.compiler.driver import CompileOptions, compile_model
from precast.runtime import ArtifactError, load
from precast.runtime.backends import BACKENDS, TARGET_NAMES, create_session
from tests.helpers import save, tiny_llm_block, tiny_mlp

# manifest.json of each kind, as the compiler wrote them before the schema was typed (commit 10513b7; ort-qnn
# from the same day's QNN build): the typed schema must read them, and write them back unchanged.
V1 = Path(__file__).parents[1] / "data" / "manifests_v1"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schema")
    compile_model(str(save(tiny_mlp(), tmp / "mlp.onnx")), tmp / "art", CompileOptions())
    return tmp / "art"


@pytest.mark.parametrize(
    "name,block",
    [
        ("ort-cpu", OrtBlock),
        ("ort-qnn", QnnBlock),
        ("triton", TritonBlock),
        ("openvino", OpenVINOBlock),
        ("tensorrt", TensorRTBlock),
        ("index", IndexTargetBlock),
        ("llm", OrtBlock),
    ],
)
def test_schema_1_manifests_load_and_round_trip(tmp_path, name, block):
    text = (V1 / f"{name}.json").read_text()
    (tmp_path / "manifest.json").write_text(text)
    manifest = read_manifest(tmp_path)
    assert type(manifest.target) is block
    written = json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n"  # as dump_json writes it
    assert written == text
    if name == "llm":
        assert manifest.llm.layers == len(manifest.llm.kv_inputs) and len(manifest.llm.kv_inputs[0]) == 2
    if name == "index":
        assert manifest.is_multi_target and set(manifest.target_dirs()) == set(manifest.fallback_order)


BLOCKS = [
    OrtBlock(
        name="ort-cpu",
        model="model.onnx",
        providers=["CPUExecutionProvider"],
        device="cpu",
        precision="fp32",
        session=SessionSettings(graph_optimization_level="all", intra_op_num_threads=2, huge_pages=False),
        offline_ort_level="none",
    ),
    QnnBlock(
        name="ort-qnn",
        providers=["QNNExecutionProvider"],
        ep_plugin=EPPlugin(ep="QNNExecutionProvider", package="onnxruntime_qnn", backend_lib="QnnHtp"),
        session=SessionSettings(config={"session.disable_cpu_ep_fallback": "1"}),
        static_shapes={"x": [2, 8]},
        placement={"on_htp": 3, "nodes": 3},
        requires={"onnxruntime": "1.32.0"},
    ),
    TritonBlock(name="triton", model="repo/m/1/model.onnx", triton={"max_batch_size": 8, "batch_dim": None}),
    OpenVINOBlock(
        name="openvino", backend="openvino", model="model.xml", weights="model.bin", config={"NUM_STREAMS": 1}
    ),
    TensorRTBlock(
        name="tensorrt", backend="tensorrt-plan", plan="plan.json", engine_built=False, notes=["plan"]
    ),
    TensorRTBlock(name="tensorrt", backend="tensorrt", tensorrt_version="10.9.0", compute_capability="9.0"),
    IndexTargetBlock(name="multi"),
]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{type(b).__name__}-{b.name}")
def test_each_target_block_round_trips(block):
    data = block.to_json()
    assert target_block_from_json(json.loads(json.dumps(data)), "m") == block
    assert None not in data.values()  # absent fields stay absent


def test_llm_spec_and_manifest_round_trip():
    spec = LLMSpec.from_json(tiny_llm_block())
    assert spec.kv_inputs == (("k", "v"),) and spec.eos_ids == (2,)
    assert LLMSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.to_json() == tiny_llm_block()  # every key written, bos_id null included
    io = IOSignature((TensorSpec("x", "float32", ("batch", 8)),), (TensorSpec("y", "float32", None),))
    manifest = Manifest(1, {"model.onnx": "ab"}, BLOCKS[0], io, llm=spec, parity={"ok": True})
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())), "m")
    assert again == manifest and again.io.inputs[0].shape == ("batch", 8)
    index = Manifest(
        1, {}, IndexTargetBlock("multi"), io, kind="multi-target", targets={"a": TargetEntry(dir="a")}
    )
    assert Manifest.from_json(index.to_json(), "m") == index


def _edited(artifact: Path, tmp_path: Path, change) -> Path:
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    change(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def _set(path: str, value):
    def change(m):
        *parents, last = path.split(".")
        node = m
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return change


_DELETE = object()
CASES = {
    "top-unknown": (_set("pipline", "x"), "manifest.json: unknown key 'pipline'"),
    "target-unknown": (
        _set("target.ort_levle", "none"),
        "manifest.json: target block 'ort-cpu': unknown key 'ort_levle'",
    ),
    "session-unknown": (
        _set("target.session.intra_op_threads", 2),
        "target block 'ort-cpu': unknown key 'session.intra_op_threads'",
    ),
    "llm-unknown": (
        _set("llm", tiny_llm_block(max_ctx=64)),
        "manifest.json: llm block: unknown key 'max_ctx'",
    ),
    "llm-missing": (
        _set("llm", {k: v for k, v in tiny_llm_block().items() if k != "vocab"}),
        "llm block: missing required key 'vocab'",
    ),
    "top-missing": (_set("io", _DELETE), "manifest.json: missing required key 'io'"),
    "top-kind": (_set("kind", "multi-targets"), "manifest.json: unknown kind 'multi-targets'"),
    "target-missing": (
        _set("target.name", _DELETE),
        "manifest.json: target block: missing required key 'name'",
    ),
    "target-type": (
        _set("target.offline_ort_level", 3),
        "target block 'ort-cpu': 'offline_ort_level' must be a string, got int",
    ),
    "llm-type": (_set("llm", tiny_llm_block(layers="1")), "llm block: 'layers' must be an integer, got str"),
    "io-type": (
        _set("io.inputs", [{"name": "x", "dtype": 1, "shape": None}]),
        "'io.inputs[0].dtype' must be a string",
    ),
    # null is not "absent": the old runtime refused these, the typed schema read them as the default
    "target-null": (_set("target.model", None), "target block 'ort-cpu': 'model' must be a string, got null"),
    "session-null": (
        _set("target.session.graph_optimization_level", None),
        "'session.graph_optimization_level' must be a string, got null",
    ),
    "io-empty": (_set("io", {}), "manifest.json: missing required key 'io.inputs'"),
    # was an OverflowError when the engine sized its arrays
    "llm-huge": (
        _set("llm", tiny_llm_block(block_size=10**30)),
        "llm block: block_size must be at most 2147483647",
    ),
    "llm-huge-id": (_set("llm", tiny_llm_block(eos_ids=[2, 2**63])), "llm block: eos_ids[1] must be at most"),
    # were internal errors (TypeError) in precast verify
    "tolerance-null": (_set("parity.tolerance", None), "'parity.tolerance' must be an object"),
    "min-cosine-null": (
        _set("parity.tolerance.min_cosine", None),
        "'parity.tolerance.min_cosine' must be a number",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_key_is_an_artifact_error_naming_it(artifact, tmp_path, case):
    change, message = CASES[case]
    art = _edited(artifact, tmp_path, change)
    with pytest.raises(ArtifactError) as e:
        load(art, verify=False)
    assert message in str(e.value) and str(e.value).startswith(str(art))


@pytest.mark.parametrize(
    "case",
    ["top-unknown", "target-unknown", "llm-unknown", "target-type", "tolerance-null", "min-cosine-null"],
)
def test_precast_verify_exits_3_naming_the_key(artifact, tmp_path, case):
    change, message = CASES[case]
    art = _edited(artifact, tmp_path, change)
    proc = subprocess.run(
        [sys.executable, "-m", "precast", "verify", str(art)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("backend", ["onnxruntme", "coreml"])
def test_an_unknown_backend_is_exit_4_naming_it_not_a_key(artifact, tmp_path, backend):
    """A misspelt backend (or a newer precast's) under an ort block: the old runtime said the backend is not
    supported (exit 4); the typed schema said "unknown key 'providers'" (exit 3), naming the wrong culprit."""
    art = _edited(artifact, tmp_path, _set("target.backend", backend))
    proc = subprocess.run(
        [sys.executable, "-m", "precast", "verify", str(art)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 4, proc.stderr
    assert f"backend '{backend}' is not supported by this runtime" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    block = read_manifest(art).target  # it still reads (inspect, integrity) and writes back as it was
    assert block.to_json() == json.loads((art / "manifest.json").read_text())["target"]


def test_a_multi_target_index_skips_a_sub_target_of_an_unknown_backend(tmp_path):
    """verify checks the files of a sub-target this runtime cannot run and reports it skipped (as before the
    typed schema); it was exit 3 naming one of that backend's keys."""
    from precast.runtime.verify import verify_artifact

    src = save(tiny_mlp(), tmp_path / "m.onnx")
    compile_model(str(src), tmp_path / "multi", CompileOptions(targets=("ort-cpu", "openvino")))
    sub = tmp_path / "multi" / "openvino" / "manifest.json"
    manifest = json.loads(sub.read_text())
    manifest["target"].update(backend="coreml", compute_units="all")
    dump_json(manifest, sub)
    index = json.loads((tmp_path / "multi" / "manifest.json").read_text())
    index["files"]["openvino/manifest.json"] = sha256_file(sub)
    dump_json(index, tmp_path / "multi" / "manifest.json")
    report = verify_artifact(tmp_path / "multi")
    assert report["ort-cpu"]["ok"] and "outputs" in report["ort-cpu"]
    assert "backend 'coreml' is not supported by this runtime" in report["openvino"]["skipped"]


def test_backends_register_every_backend_precast_writes(artifact, tmp_path):
    """The registry holds exactly precast's own backends; an unknown one is refused, never imported."""
    create_session(artifact, read_manifest(artifact).target, 1)  # fills the registry
    assert set(BACKENDS) == {"onnxruntime", "openvino", "tensorrt", "tensorrt-plan"}
    assert "triton" in TARGET_NAMES
    from precast.errors import TargetUnavailableError

    with pytest.raises(TargetUnavailableError, match="backend 'os.system' is not supported"):
        create_session(artifact, TargetBlock(name="x", backend="os.system"), 1)


def test_the_engine_block_build_engine_py_writes_reads_as_a_tensorrt_block():
    """build_engine.py turns a plan's block into an engine's on the GPU host, without precast (plain JSON)."""
    from precast.targets.trt_engine_builder import engine_block

    plan = TensorRTBlock(
        name="tensorrt",
        backend="tensorrt-plan",
        model="model.onnx",
        device="cuda",
        precision="fp16",
        profiles={"x": {"min": [1, 8], "opt": [2, 8], "max": [8, 8]}},
        prepared_with="onnx-graphsurgeon 0.6.1",
        plan="plan.json",
        engine_built=False,
        why_plan="no GPU here",
        verified_as="prepared ONNX on onnxruntime CPU",
        notes=["plan only"],
    )
    built = engine_block(plan.to_json(), {"tensorrt_version": "10.9.0", "compute_capability": "9.0"})
    block = target_block_from_json(built, "manifest.json")
    assert type(block) is TensorRTBlock and not block.is_plan and block.model_file == "model.engine"
    assert (block.onnx, block.tensorrt_version, block.compute_capability) == ("model.onnx", "10.9.0", "9.0")
    assert block.plan is None and block.notes is None and block.profiles == plan.profiles
