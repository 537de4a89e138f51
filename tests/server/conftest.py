"""Fixtures for the server tests: tiny compiled artifacts and a uvicorn server on 127.0.0.1 (free port)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.helpers import make_model, save, tiny_mlp

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


def compile_tiny(model, out: Path, **opts) -> Path:
    from precast.compiler.driver import CompileOptions, compile_model

    out.parent.mkdir(parents=True, exist_ok=True)
    src = save(model, out.parent / f"{out.name}.onnx")
    compile_model(str(src), out, CompileOptions(**opts))
    return out


@pytest.fixture(scope="session")
def mlp_a(tmp_path_factory) -> Path:
    return compile_tiny(tiny_mlp(seed=0), tmp_path_factory.mktemp("a") / "mlp")


@pytest.fixture(scope="session")
def mlp_b(tmp_path_factory) -> Path:
    """Same signature as mlp_a, different weights: version 2 of the model."""
    return compile_tiny(tiny_mlp(seed=1), tmp_path_factory.mktemp("b") / "mlp")


@pytest.fixture(scope="session")
def mlp_tampered(mlp_b, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("bad") / "mlp"
    shutil.copytree(mlp_b, copy)
    data = bytearray((copy / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (copy / "model.onnx").write_bytes(bytes(data))
    return copy


VOCAB = ["[PAD]", "[UNK]", "hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def encoder_table(dim: int = 6) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((len(VOCAB), dim)).astype(np.float32)


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """input_ids/attention_mask/token_type_ids -> last_hidden_state = table[input_ids], plus a shipped tokenizer."""
    pytest.importorskip("tokenizers")
    from precast.artifact.manifest import dump_json, sha256_file

    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["last_hidden_state"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["token_type_ids"], ["t"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["m", "t"], ["mt"]),
        helper.make_node("ReduceSum", ["mt", "axes"], ["lengths"], keepdims=0),
    ]
    model = make_model(
        nodes,
        [
            ("input_ids", TensorProto.INT64, ["batch", "seq"]),
            ("attention_mask", TensorProto.INT64, ["batch", "seq"]),
            ("token_type_ids", TensorProto.INT64, ["batch", "seq"]),
        ],
        [
            ("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", 6]),
            ("lengths", TensorProto.FLOAT, ["batch"]),
        ],
        {"table": encoder_table(), "axes": np.array([1], np.int64)},
    )
    out = tmp_path_factory.mktemp("enc") / "encoder"
    compile_tiny(model, out, dims={"batch": 2, "seq": 5})
    (out / "tokenizer").mkdir()
    _word_tokenizer().save(str(out / "tokenizer" / "tokenizer.json"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = sha256_file(out / "tokenizer" / "tokenizer.json")
    dump_json(manifest, out / "manifest.json")
    return out


@contextmanager
def live_server(config, state=None):
    """A real uvicorn server for ``config`` (and ``state``, default: built from it) on 127.0.0.1 and a
    kernel-chosen port, with serve()'s uvicorn settings; yields (url, state)."""
    import uvicorn

    from precast.runtime.server import uvicorn_config
    from precast.runtime.server.app import create_app

    app = create_app(config, state)
    server = uvicorn.Server(
        uvicorn_config(
            app, config, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=10
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app.state.precast
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def v2_body(x: np.ndarray, name: str = "x") -> dict:
    return {
        "inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }


def v2_output(resp_json: dict, name: str = "y") -> np.ndarray:
    out = next(o for o in resp_json["outputs"] if o["name"] == name)
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
