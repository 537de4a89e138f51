"""Hostile artifacts whose structure or numbers crashed a loader are refused: exit 3, one line naming the
file and the field, from every command that loads them.

Before, each ended as exit 70 ("internal error"): a multi-target index whose target folder is the index
itself (RecursionError), an index whose target is another index (KeyError in `verify`), an OpenVINO IR whose
rt_info or a manifest whose ``llm.max_context`` sized a KV pool past memory, an ``llm.vocab`` the graph's
logits do not have (ONNX Runtime failed at serve start). Each case edits a real compiled artifact as an attacker would and
re-hashes the files it changed (manifest.json is not covered by its own hashes).

`inspect` and `pack` read the manifest only (pack checks the hashes too): a manifest that contradicts itself is
refused there; numbers that only the model graph can contradict are refused by the commands that open it
(`verify`, `run`, `serve`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precast.artifact.llm_spec import DEFAULT_POOL_BYTES, LIMITS
from precast.compiler.driver import CompileOptions, compile_model
from tests.helpers import edit_manifest, save, tiny_mlp

MANIFEST_ONLY = ("inspect", "pack")
LOADING = ("verify", "run", "serve")
EVERY = MANIFEST_ONLY + LOADING


@pytest.fixture(scope="module")
def mlp_index(tmp_path_factory):
    """A multi-target index of a tiny MLP (ort-cpu, and a TensorRT build plan this host skips)."""
    tmp = tmp_path_factory.mktemp("bounds")
    src = save(tiny_mlp(), tmp / "mlp.onnx")
    compile_model(str(src), tmp / "multi", CompileOptions(targets=["ort-cpu", "tensorrt"]))
    return tmp / "multi"


@pytest.fixture(scope="module")
def ov_llm(compiled, tiny_llama_dir):
    """The tiny Llama compiled for OpenVINO (PagedAttention step graph; kv_layout ov-paged)."""
    pytest.importorskip("openvino")
    return compiled(tiny_llama_dir, targets=("openvino",), task="causal-lm").output


@pytest.fixture
def llm(request, llm_artifact):
    """The tiny Llama compiled for ort-cpu (tests/conftest.py) or for OpenVINO, by the test's parameter."""
    return llm_artifact if request.param == "ort" else request.getfixturevalue("ov_llm")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _rehash(root: Path, rel: str) -> None:
    digest = hashlib.sha256((root / rel).read_bytes()).hexdigest()
    edit_manifest(root, lambda m: m["files"].__setitem__(rel, digest))


def _set_llm(**values):
    return lambda m: m["llm"].update(values)


def _refused(cli, art: Path, tmp_path: Path, commands, *names: str) -> None:
    """Each command exits 3 with one line on stderr holding every one of ``names`` (the file, the field)."""
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, input_ids=np.zeros((1, 1), np.int64))
    for cmd in commands:
        if cmd == "serve":  # a process of its own: one that wrongly starts is killed at the timeout
            proc = subprocess.run(
                [sys.executable, "-m", "precast", "serve", str(art), "--port", "0"],
                capture_output=True,
                text=True,
                timeout=180,
            )
            code, err = proc.returncode, proc.stderr
        else:
            extra = {"pack": ["-o", tmp_path / "a.precast"], "run": ["-i", feeds]}.get(cmd, [])
            got = cli(cmd, art, *extra)
            code, err = got.code, got.err
        lines = err.strip().splitlines()
        assert code == 3 and len(lines) == 1, (cmd, code, err)
        assert all(n in lines[0] for n in names), (cmd, lines[0], names)


def test_index_target_dir_that_is_the_index_itself_is_refused(cli, mlp_index, tmp_path):
    """``targets.ort-cpu.dir: "."``: verify, pack and serve recursed into the index until RecursionError
    (exit 70), inspect printed it (exit 0)."""
    art = edit_manifest(_copy(mlp_index, tmp_path / "art"), lambda m: m["targets"]["ort-cpu"].update(dir="."))
    _refused(cli, art, tmp_path, EVERY, f"{art}/manifest.json", "'targets.ort-cpu.dir' = '.'", "own folder")


def test_index_whose_target_is_another_index_is_refused(cli, mlp_index, tmp_path):
    """The ort-cpu folder holds an index (of the real sub-artifact, one level down): verify read the inner
    index's report as a target's and died on KeyError 'outputs' (exit 70)."""
    art = _copy(mlp_index, tmp_path / "art")
    index = json.loads((art / "manifest.json").read_text())
    (art / "ort-cpu").rename(tmp_path / "leaf")
    _copy(tmp_path / "leaf", art / "ort-cpu" / "leaf")
    inner = {**index, "targets": {"ort-cpu": {"dir": "leaf"}}, "fallback_order": ["ort-cpu"], "files": {}}
    (art / "ort-cpu" / "manifest.json").write_text(json.dumps(inner))
    _rehash(art / "ort-cpu", "leaf/manifest.json")
    _rehash(art, "ort-cpu/manifest.json")
    _refused(
        cli, art, tmp_path, EVERY, f"{art}/manifest.json", "'targets.ort-cpu.dir'", "another multi-target"
    )


@pytest.mark.parametrize(
    "head_size, why",
    [(4096, "must be in [1, 1024], got 4096"), (64, "= 2 x 64 does not match the graph")],
    ids=["absurd", "not-the-graph"],
)
def test_openvino_ir_head_size_must_fit_its_graph(cli, ov_llm, tmp_path, head_size, why):
    """rt_info ``precast_paged_attention.head_size`` sizes OpenVINO's KV pool: 4096 (x 2 KV heads) on a graph
    whose keys are 32 wide failed copying into the pool (exit 70); a larger one ran out of memory mapping it.
    Now it must be within LIMITS and num_kv_heads x head_size must be the PagedAttention nodes' key width."""
    art = _copy(ov_llm, tmp_path / "art")
    xml = (art / "model.xml").read_text()
    assert xml.count('<head_size value="16" />') == 1
    (art / "model.xml").write_text(
        xml.replace('<head_size value="16" />', f'<head_size value="{head_size}" />')
    )
    _rehash(art, "model.xml")
    _refused(cli, art, tmp_path, LOADING, f"{art}/model.xml", "'precast_paged_attention.head_size'", why)


@pytest.mark.parametrize("llm", ["ort", "openvino"], indirect=True)
def test_llm_max_context_is_bounded(cli, llm, tmp_path):
    """``llm.max_context`` 2^31-1: the default KV pool (4 full contexts) was terabytes; the mapped layout
    filled a [slots, context / block] table (18 GB resident before the first step failed), OpenVINO's pool
    mmap failed with ENOMEM (exit 70)."""
    art = edit_manifest(_copy(llm, tmp_path / "art"), _set_llm(max_context=2**31 - 1))
    limit = LIMITS["max_context"]
    _refused(cli, art, tmp_path, EVERY, f"{art}/manifest.json", f"max_context must be at most {limit}")


def test_the_default_kv_pool_is_capped_not_sized_by_max_context(llm_artifact, tmp_path):
    """At the limit (2^20 tokens) the artifact loads and serves; with no pool size given, 4 full contexts
    would be 2 GiB here and terabytes for a large model: the pool is capped at DEFAULT_POOL_BYTES, and a
    size given by the caller (`serve --num-blocks` / `--kv-cache-memory`) is used as given."""
    from precast.artifact.llm_spec import LLMSpec
    from precast.runtime.llm import Engine
    from precast.runtime.llm.sampler import SamplingParams

    art = edit_manifest(_copy(llm_artifact, tmp_path / "art"), _set_llm(max_context=LIMITS["max_context"]))
    spec = LLMSpec.from_json(json.loads((art / "manifest.json").read_text())["llm"])
    big = dataclasses.replace(spec, layers=64, heads=32, kv_heads=16, head_size=256)  # 32 MiB a block
    assert big.default_num_blocks() * 64 * 2 * 16 * big.block_size * 256 * 4 <= DEFAULT_POOL_BYTES
    engine = Engine.load(art, verify=False)
    try:
        assert engine.runner.kv_bytes <= DEFAULT_POOL_BYTES
        assert engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    finally:
        engine.close()
    assert Engine.load(art, num_blocks=8, verify=False).pool.num_blocks == 8


def _inflated_vocab(art: Path) -> tuple:
    edit_manifest(art, _set_llm(vocab=1 << 20))
    return EVERY, "'logits' is [batch*logit_rows,512], the block says vocab=1048576"


def _inflated_vocab_and_io(art: Path) -> tuple:
    def change(m):
        m["llm"]["vocab"] = 600
        next(o for o in m["io"]["outputs"] if o["name"] == "logits")["shape"][-1] = 600

    edit_manifest(art, change)
    return LOADING, "vocab=600, but the step graph's logits are [batch*logit_rows, 512]"


def _tokenizer_past_vocab(art: Path) -> tuple:
    tok = json.loads((art / "tokenizer" / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][0], "id": 9999, "content": "<evil>"})
    (art / "tokenizer" / "tokenizer.json").write_text(json.dumps(tok))
    _rehash(art, "tokenizer/tokenizer.json")
    return ("serve",), "vocab=512 is smaller than the tokenizer's 513 tokens"


@pytest.mark.parametrize(
    "make",
    [_inflated_vocab, _inflated_vocab_and_io, _tokenizer_past_vocab],
    ids=["llm", "llm+io", "tokenizer"],
)
def test_llm_vocab_must_match_the_logits_and_the_tokenizer(cli, llm_artifact, tmp_path, make):
    """An ``llm.vocab`` above the graph's logits width sized the runner's logits buffer past the graph's
    output: ONNX Runtime refused the binding at serve start (exit 70). The block is compared with the
    manifest's own ``io`` (every command), with the graph's logits where static (every command that opens
    it) and with the tokenizer, whose ids must all have a logits row (the engine)."""
    art = _copy(llm_artifact, tmp_path / "art")
    commands, why = make(art)
    _refused(cli, art, tmp_path, commands, f"{art}/manifest.json", why)


def test_a_symlink_loop_named_by_the_manifest_is_refused(cli, mlp_index, tmp_path):
    """Path.resolve() raised RuntimeError on a symlink loop (exit 70)."""
    art = _copy(mlp_index / "ort-cpu", tmp_path / "art")
    (art / "loop").symlink_to("loop")
    edit_manifest(art, lambda m: m["target"].update(model="loop"))
    _refused(cli, art, tmp_path, ("inspect", "verify"), f"{art}/manifest.json", "'target.model' = 'loop'")
