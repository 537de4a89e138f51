"""Property tests (hypothesis): the pipeline parser, the manifest loader and the archive reader take any
input and answer with a result or a typed error - never a crash, never a write outside the target dir."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from precast.artifact.archive import unpack_artifact
from precast.artifact.manifest import Manifest, check_integrity, read_manifest
from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.pack import pack_artifact
from precast.errors import ArtifactError, PipelineError
from precast.ir.pipeline import PassSpec, format_pipeline, parse_pipeline
from precast.ir.registry import all_passes, option_fields
from tests.ci.archive_helpers import tree
from tests.helpers import save, tiny_mlp

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)

# ---------------------------------------------------------------- pipeline parser

PASS_NAMES = sorted(all_passes())
_PIPE_ALPHABET = "abcdefghijklmnopqrstuvwxyz-_{}[],= 0123456789.\t"
_tokens = st.sampled_from(
    PASS_NAMES + ["default", "{", "}", "[", "]", ",", "=", "true", "16", "block", "x", " "]
)
pipeline_text = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=_PIPE_ALPHABET, max_size=60),
    st.lists(_tokens, max_size=16).map("".join),
)


@FUZZ
@given(pipeline_text)
def test_parse_any_string_gives_specs_or_pipeline_error(text):
    try:
        specs = parse_pipeline(text, default="fold-constants")
    except PipelineError as e:
        assert "\n" not in str(e)
        return
    assert all(isinstance(s, PassSpec) for s in specs)
    assert parse_pipeline(format_pipeline(specs)) == specs


_WORD = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:-", min_size=1, max_size=12
)


def _value(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.one_of(st.none(), _value(args[0]))
    if origin in (tuple, list):
        return st.lists(_value(typing.get_args(tp)[0]), max_size=3).map(tuple)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if tp is bool:
        return st.booleans()
    if tp is int:  # common legal values (block sizes, levels) as often as arbitrary ones
        return st.one_of(st.sampled_from([0, 1, 4, 16, 32, 64, 128, 256, 8192]), st.integers(-(2**40), 2**40))
    if tp is float:
        return st.one_of(st.floats(0, 1), st.floats(allow_nan=False, allow_infinity=False, width=64))
    return _WORD.filter(lambda w: w.lower() not in ("none", "null", "true", "false"))


@st.composite
def pass_specs(draw):
    name = draw(st.sampled_from(PASS_NAMES))
    cls = all_passes()[name]
    values = {n: draw(_value(t)) for n, t, _ in option_fields(cls.Options)}
    try:
        options = cls.Options(**values)
    except (TypeError, ValueError, PipelineError):
        assume(False)
    return PassSpec(name, options)


@FUZZ
@given(st.lists(pass_specs(), max_size=5))
def test_format_then_parse_round_trips(specs):
    text = format_pipeline(specs)
    try:
        parsed = parse_pipeline(text)
    except PipelineError:  # option values a pass's own validation refuses when parsed from text
        assume(False)
    assert parsed == specs
    assert format_pipeline(parsed) == text


# ---------------------------------------------------------------- manifest loader

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_paths = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["../x", "/etc/passwd", "a/../../b", "", ".", "a//b", "manifest.json", "x\0y"]),
)
manifest_like = st.fixed_dictionaries(
    {"schema_version": st.one_of(st.integers(-2, 3), json_values)},
    optional={
        "files": st.one_of(
            st.dictionaries(_paths, st.one_of(st.text(max_size=64), json_values), max_size=4), json_values
        ),
        "target": json_values,
        "io": json_values,
        "kind": st.sampled_from(["multi-target", "x"]),
        "targets": json_values,
    },
)


@FUZZ
@given(st.one_of(json_values, manifest_like), st.booleans())
def test_manifest_loader_gives_a_manifest_or_artifact_error(doc, raw_bytes):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "manifest.json").write_text(json.dumps(doc) if not raw_bytes else json.dumps(doc)[:-1])
        try:
            manifest = read_manifest(root)
        except ArtifactError:
            return
        assert isinstance(manifest, Manifest)
        try:
            check_integrity(root, manifest)
        except ArtifactError:
            pass


# ---------------------------------------------------------------- archive reader


@pytest.fixture(scope="module")
def packed_bytes(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("fuzzpack")
    art = compile_model(
        str(save(tiny_mlp(hidden=4), root / "m.onnx")), root / "art", CompileOptions(passes="")
    ).output
    pack_artifact(art, root / "m.precast")
    return (root / "m.precast").read_bytes()


def _unpack_in_sandbox(data: bytes) -> None:
    """Unpack ``data``; assert a typed error or a clean result, and that nothing landed outside ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        sandbox = Path(tmp) / "sandbox"
        sandbox.mkdir()
        archive = Path(tmp) / "in.precast"
        archive.write_bytes(data)
        try:
            unpack_artifact(archive, sandbox / "out")
            ok = True
        except ArtifactError:
            ok = False
        inside = tree(sandbox)
        assert all(p == "out" or p.startswith("out/") for p in inside), inside
        assert ok or inside == []
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["in.precast", "sandbox"]


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data):
    _unpack_in_sandbox(data)


@FUZZ
@given(st.data())
def test_mutated_packs(packed_bytes, data):
    buf = bytearray(packed_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    _unpack_in_sandbox(bytes(buf))


_member_names = st.one_of(
    st.sampled_from(
        [
            "manifest.json",
            "model.onnx",
            "../evil",
            "/abs",
            "a/../../evil",
            "./x",
            "a//b",
            "parity",
            "x\\y",
            "MANIFEST.JSON",
        ]
    ),
    st.text(alphabet="abc./-_", min_size=1, max_size=10),
)
_types = st.sampled_from(
    [tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE]
)


@FUZZ
@given(st.data())
def test_random_members(packed_bytes, data):
    """Start from the honest pack's members (often kept), then add hostile ones."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(packed_bytes)) as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in src.getmembers():
            if data.draw(st.booleans()):
                dst.addfile(m, src.extractfile(m))
        for _ in range(data.draw(st.integers(0, 4))):
            ti = tarfile.TarInfo(data.draw(_member_names))
            ti.type = data.draw(_types)
            ti.linkname = data.draw(st.sampled_from(["", "/etc/passwd", "../x", "model.onnx"]))
            payload = data.draw(st.binary(max_size=64)) if ti.type == tarfile.REGTYPE else b""
            ti.size = len(payload)
            dst.addfile(ti, io.BytesIO(payload) if payload or ti.type == tarfile.REGTYPE else None)
    _unpack_in_sandbox(out.getvalue())
