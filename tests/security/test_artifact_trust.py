"""An artifact is untrusted data: nothing in its manifest may choose code to import or a path outside it.

Each case edits the manifest of a real compiled artifact the way an attacker would (manifest.json is not
covered by its own hashes; a signed pack covers it, so those cases sign the edited manifest validly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from precast.artifact.signing import generate_keypair
from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.pack import pack_artifact
from precast.errors import PrecastError
from precast.runtime import ArtifactError, IntegrityError, load
from tests.helpers import edit_manifest, save, tiny_llm_block, tiny_mlp

EVIL = "import pathlib; pathlib.Path({marker!r}).write_text('pwned')\n"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    src = save(tiny_mlp(), tmp / "mlp.onnx")
    compile_model(str(src), tmp / "art", CompileOptions())
    return tmp / "art"


def _copy(artifact: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for p in artifact.rglob("*"):
        if p.is_file():
            (dest / p.relative_to(artifact)).parent.mkdir(parents=True, exist_ok=True)
            (dest / p.relative_to(artifact)).write_bytes(p.read_bytes())
    return dest


def _as_plugin(package: str):
    def change(m):
        m["target"]["ep_plugin"] = {"ep": "QNNExecutionProvider", "package": package, "backend_lib": "QnnHtp"}
        m["target"]["providers"] = ["QNNExecutionProvider"]

    return change


@pytest.mark.parametrize("package", ["evil_plugin", "onnxruntime_qnn"])
@pytest.mark.parametrize("how", ["verify", "load", "signed-pack"])
def test_manifest_never_chooses_python_to_import(artifact, tmp_path, package, how):
    """A module named like the manifest's package sits in the working directory (first on sys.path for
    ``python -m``). Before: it ran on load / verify / a validly signed unpack. Now nothing imports it."""
    art = edit_manifest(_copy(artifact, tmp_path / "art"), _as_plugin(package))
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "pwned"
    (work / f"{package}.py").write_text(EVIL.format(marker=str(marker)))
    if how == "verify":
        cmd = [sys.executable, "-m", "precast", "verify", str(art)]
    elif how == "load":
        code = (
            "import sys, precast.runtime as rt\n"
            f"try:\n    rt.load({str(art)!r})\n"
            "except rt.PrecastError as e:\n    sys.exit(print(e, file=sys.stderr) or e.exit_code)\n"
        )
        cmd = [sys.executable, "-c", code]
    else:
        generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
        pack_artifact(art, tmp_path / "a.precast", sign_key=tmp_path / "k.pem")
        cmd = [
            sys.executable,
            "-m",
            "precast",
            "verify",
            str(tmp_path / "a.precast"),
            "--pubkey",
            str(tmp_path / "k.pub"),
        ]
    env = {**os.environ, "PYTHONPATH": str(work)}  # the attacker's module on sys.path, ahead of site-packages
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "the manifest's package name made the runtime import attacker code"
    assert "Traceback" not in proc.stderr, proc.stderr
    if package == "evil_plugin":
        assert proc.returncode == 3 and "evil_plugin" in proc.stderr and "onnxruntime-qnn" in proc.stderr


def test_unknown_plugin_ep_and_unsafe_options_are_refused(artifact, tmp_path):
    cases = {
        "ep": (
            lambda m: m["target"].update(ep_plugin={"ep": "EvilExecutionProvider"}),
            "EvilExecutionProvider",
        ),
        "backend_lib": (
            lambda m: m["target"].update(
                ep_plugin={"ep": "QNNExecutionProvider", "backend_lib": "../../evil"}
            ),
            "backend library",
        ),
        "backend_path": (
            lambda m: (
                _as_plugin("onnxruntime_qnn")(m),
                m["target"].update(provider_options={"backend_path": "/x.so"}),
            ),
            "provider option 'backend_path'",
        ),
        "config": (
            lambda m: (
                _as_plugin("onnxruntime_qnn")(m),
                m["target"].update(session={"config": {"ep.context_file_path": "/tmp/x.onnx"}}),
            ),
            "session config key 'ep.context_file_path'",
        ),
    }
    for name, (change, why) in cases.items():
        art = edit_manifest(_copy(artifact, tmp_path / name), change)
        with pytest.raises(ArtifactError, match=why):
            load(art)


@pytest.mark.parametrize(
    "where,value",
    [
        ("target.model", "/etc/passwd"),
        ("target.model", "../outside.onnx"),
        ("target.model", "symlink"),
        ("llm.tokenizer", "../../tokenizer.json"),
        ("parity.inputs.x", "/etc/hostname"),
        ("targets.ort-cpu.dir", ".."),
    ],
)
def test_manifest_paths_stay_inside_the_artifact(artifact, tmp_path, where, value):
    """Before: load() opened (and ran) whatever the model path named, even from a signed pack."""
    outside = tmp_path / "outside.onnx"
    outside.write_bytes((artifact / "model.onnx").read_bytes())  # a model that would load and run
    art = _copy(artifact, tmp_path / "art")
    if value == "symlink":
        (art / "link.onnx").symlink_to(outside)
        value = "link.onnx"

    def change(m):
        *path, last = where.split(".")
        if path[0] == "targets":
            m["kind"] = "multi-target"
            m["targets"] = {"ort-cpu": {}}
        if path[0] == "llm":
            m["llm"] = tiny_llm_block()
        node = m
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value

    edit_manifest(art, change)
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=r"outside the artifact|symlink"):
            load(art, verify=verify)


def test_signed_pack_with_outside_model_path_is_refused(artifact, tmp_path):
    outside = tmp_path / "outside.onnx"
    outside.write_bytes((artifact / "model.onnx").read_bytes())
    art = edit_manifest(_copy(artifact, tmp_path / "art"), lambda m: m["target"].update(model=str(outside)))
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    with pytest.raises(PrecastError, match="outside the artifact"):  # the packer refuses to ship it ...
        pack_artifact(art, tmp_path / "a.precast", sign_key=tmp_path / "k.pem")


@pytest.mark.parametrize(
    "text,why",
    [
        ('{"schema_version": true, "files": {}, "target": {}, "io": {}}', "non-integer schema_version"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"schema_version": 1' + "0" * 5000 + "}", "not valid JSON"),
    ],
    ids=["bool-version", "deep-nesting", "huge-int"],
)
def test_malformed_manifest_json_is_a_clean_error(artifact, tmp_path, text, why):
    art = _copy(artifact, tmp_path / "art")
    data = text if isinstance(text, bytes) else text.encode()
    (art / "manifest.json").write_bytes(data)
    with pytest.raises(ArtifactError, match=why):
        load(art)
    proc = subprocess.run(
        [sys.executable, "-m", "precast", "inspect", str(art)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("compression", ["bz2", "gz", "xz"])
@pytest.mark.parametrize("kind", [b"L", b"x"])  # GNU long name, pax extended header
def test_archive_metadata_header_bomb_is_refused_before_reading(tmp_path, compression, kind):
    """A tiny compressed tar whose long-name (or pax) header declares 1 GB: tarfile read the whole
    payload into memory before any check (RSS past 1 GB, then MemoryError, exit 70). Now it is refused
    from the header alone; here 64 MiB of real zeros follow, and the peak allocation stays small."""
    import bz2
    import gzip
    import lzma
    import tarfile
    import tracemalloc

    from precast.artifact.archive import ArchiveError, unpack_artifact

    declared = 1 << 30
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = kind, declared
    raw = header.tobuf(format=tarfile.GNU_FORMAT)[:512] if kind == b"L" else None
    if raw is None:  # a pax header block, built by hand (tobuf would encode the payload itself)
        header.name = "pax"
        raw = header.tobuf(format=tarfile.USTAR_FORMAT)[:512]
    compress = {"bz2": bz2.compress, "gz": gzip.compress, "xz": lzma.compress}[compression]
    bomb = tmp_path / f"bomb.tar.{compression}"
    bomb.write_bytes(compress(raw + bytes(64 << 20)))
    assert bomb.stat().st_size < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(ArchiveError, match="metadata header declares 1073741824 bytes"):
            unpack_artifact(bomb, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak >> 20} MiB while rejecting a header bomb"
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == [bomb.name]


def test_session_settings_from_the_manifest_are_typed(artifact, tmp_path):
    """intra_op_num_threads "abc" was int()-ed into a ValueError traceback (exit 70)."""
    for i, bad in enumerate(["abc", -1, 10**9, True]):
        art = edit_manifest(
            _copy(artifact, tmp_path / f"t{i}"),
            lambda m, bad=bad: m["target"]["session"].update(intra_op_num_threads=bad),
        )
        with pytest.raises(ArtifactError, match="intra_op_num_threads"):
            load(art)


def test_openvino_properties_from_the_manifest_are_allow_listed(tmp_path):
    """CACHE_DIR (or any property naming a path) in a manifest would make the runtime write where the
    artifact says."""
    from precast.runtime.backends.openvino import _checked_config

    assert _checked_config(tmp_path, {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}) == {
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": "1",
    }
    with pytest.raises(ArtifactError, match="property 'CACHE_DIR' is not allowed"):
        _checked_config(tmp_path, {"CACHE_DIR": "/home/user/.ssh"})
    with pytest.raises(ArtifactError, match="must be a string or number"):
        _checked_config(tmp_path, {"NUM_STREAMS": {"a": 1}})


def test_stage_of_a_killed_unpack_is_cleaned_on_the_next_unpack(artifact, tmp_path):
    from precast.artifact.archive import unpack_artifact
    from precast.artifact.staging import host_id

    pack_artifact(artifact, tmp_path / "a.precast")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)  # that process has exited: its pid names nobody (or, rarely, a newer process)
    stale = tmp_path / f".out.unpack-{pid}-{host_id()}-0123abcd"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.onnx").write_bytes(b"half-written")
    alive = tmp_path / f".out.unpack-{os.getpid()}-{host_id()}-4567cdef"
    alive.mkdir()  # a running unpack's stage (this process) is left alone
    unpack_artifact(tmp_path / "a.precast", tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert not stale.exists() and alive.exists()


def test_a_symlinked_folder_anywhere_in_the_artifact_is_refused(artifact, tmp_path):
    """A symlink to a folder outside (unlisted, so its files were never hashed) passed `verify`: rglob does not
    follow it and the folder check skipped it. An LLM server then read its chat template from outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer_config.json").write_text('{"chat_template": "evil"}')
    art = _copy(artifact, tmp_path / "art")
    (art / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(IntegrityError, match="'tokenizer' is a symlink"):
        load(art)
    proc = subprocess.run(
        [sys.executable, "-m", "precast", "verify", str(art)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3 and "symlink" in proc.stderr, proc.stderr


def test_unlisted_chat_template_is_not_used(tmp_path):
    """Even without integrity checks (verify=False), the served chat template must be a hashed file inside."""
    from precast.runtime.server.llm_service import template_source

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text('{"chat_template": "EVIL {{ messages }}"}')
    assert template_source(tmp_path, {}) is None  # the default ChatML
    assert "EVIL" in template_source(tmp_path, {"tokenizer/tokenizer_config.json": "x"})


@pytest.mark.parametrize(
    "change,why",
    [
        (
            lambda m: m["target"].update(providers=[["CPUExecutionProvider", {}]]),
            r"target block 'ort-cpu': 'providers\[0\]' must be a string",
        ),
        (lambda m: m.setdefault("parity", {}).update(tolerance={"evil": 1}), "parity.tolerance"),
        (lambda m: m.setdefault("parity", {}).update(tolerance="x"), "parity.tolerance"),
        (lambda m: m.setdefault("parity", {}).update(inputs="parity/x.npy"), "parity.inputs"),
        (lambda m: m["io"].update(inputs=5), "io.inputs"),
    ],
    ids=["providers", "tolerance-key", "tolerance-str", "parity-inputs", "io-inputs"],
)
def test_malformed_manifest_fields_are_exit_3_not_a_crash(artifact, tmp_path, change, why):
    art = edit_manifest(_copy(artifact, tmp_path / "art"), change)
    with pytest.raises(ArtifactError, match=why):
        load(art)
    for cmd in ("verify", "inspect"):
        proc = subprocess.run(
            [sys.executable, "-m", "precast", cmd, str(art)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, (cmd, proc.stderr)


def _rename_first_kv_input(m):
    m["llm"]["kv_inputs"][0][0] = "evil.0"


def _swap_kv_heads(m):
    m["llm"]["kv_heads"] += 1


def _layout_of_the_other_kind(m):
    m["llm"]["kv_layout"] = "paged" if m["llm"]["kv_layout"] == "mapped" else "mapped"


def _rename_a_kv_output(m):
    m["llm"]["kv_outputs"][-1][1] = "nope"


@pytest.mark.parametrize(
    "change, why",
    [
        (_rename_first_kv_input, "'evil.0' is not an input of the step graph"),
        (_swap_kv_heads, "the block says kv_heads="),
        (_layout_of_the_other_kind, "is not an input of the step graph"),
        (_rename_a_kv_output, "'nope' is not an output of the step graph"),
    ],
)
def test_an_llm_block_that_does_not_match_its_graph_is_refused(llm_artifact, tmp_path, change, why):
    """The llm block is read from the untrusted manifest: names, layout or sizes the graph does not have were
    an internal error inside ONNX Runtime at the first step (exit 70); now loading refuses the artifact."""
    from precast.runtime.llm import Engine

    root = edit_manifest(_copy(llm_artifact, tmp_path / "a"), change)
    with pytest.raises(ArtifactError, match=why) as e:
        Engine.load(root, num_blocks=8).generate("hi")
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
