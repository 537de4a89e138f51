"""The compile plan: option mistakes fail before any work (no export), and an HF cache hit skips the export."""

from __future__ import annotations

import time

import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from tests.helpers import one_line_error

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT folder (weights N(0, 0.1), safetensors, no tokenizer)."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, 0, 0.1)
    folder = tmp_path_factory.mktemp("hf") / "tiny-bert"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture
def no_export(monkeypatch):
    """Any torch export (or HF load) raises: a test that passes did its checks before the export."""

    def boom(*_a, **_k):
        raise AssertionError("the export ran")

    monkeypatch.setattr("precast.compiler.frontends.hf_source.load_hf_folder", boom)
    monkeypatch.setattr("precast.compiler.frontends.torch_export.export_module", boom)


def _fast_error(cli, *args, code=1, needles=()):
    """The command fails with one line naming ``needles``, before any export (the patched loaders raise if
    reached); the time is only a sanity bound, loose enough for a busy host (a quiet one: well under 1 s)."""
    cli(*args)
    t = time.perf_counter()
    r = cli(*args)
    seconds = time.perf_counter() - t
    line = one_line_error(r, code, *needles)
    assert seconds < 10.0, f"{seconds:.2f}s: {line}"
    return line


def test_bad_target_option_value_fails_before_the_export(cli, tiny_bert, tmp_path, no_export):
    out = tmp_path / "o"
    _fast_error(
        cli,
        "compile", tiny_bert, "-o", out, "--target-option", "ort_level=bogus",
        needles=("target 'ort-cpu' option 'ort_level'", "none|basic|extended", "'bogus'"),
    )  # fmt: skip
    _fast_error(
        cli,
        "compile", tiny_bert, "-o", out, "--target-option", "ort_levl=basic",
        needles=("no option 'ort_levl'", "did you mean 'ort_level'"),
    )  # fmt: skip
    assert not out.exists()


def test_dim_the_hf_model_lacks_fails_before_the_export(cli, tiny_bert, tmp_path, no_export):
    _fast_error(
        cli,
        "compile", tiny_bert, "-o", tmp_path / "o", "--dim", "seq=16",
        needles=("--dim 'seq'", "has: batch, sequence"),
    )  # fmt: skip


def test_dim_on_an_onnx_file_is_checked_against_its_graph(cli, tmp_path):
    from tests.helpers import save, tiny_mlp

    model = save(tiny_mlp(), tmp_path / "mlp.onnx")
    _fast_error(cli, "compile", model, "-o", tmp_path / "o", "--dim", "seq=16", needles=("--dim 'seq'",))


def test_report_into_a_missing_folder_fails_before_the_export(cli, tiny_bert, tmp_path, no_export):
    for option in ("--report", "--junit"):
        _fast_error(
            cli,
            "compile", tiny_bert, "-o", tmp_path / "o", option, tmp_path / "missing" / "r.json",
            needles=(option, "does not exist"),
        )  # fmt: skip


def test_text_calibration_of_an_encoder_fails_before_the_export(cli, tiny_bert, tmp_path, no_export):
    text = tmp_path / "calib.txt"
    text.write_text("some text to calibrate on\n" * 4)
    _fast_error(
        cli,
        "compile", tiny_bert, "-o", tmp_path / "o", "--passes", "default,quantize-int8", "--calibration", text,
        needles=("--calibration text calibrates causal-lm models",),
    )  # fmt: skip


def test_plan_from_python_raises_the_same_errors(tiny_bert, tmp_path, no_export):
    with pytest.raises(UsageError, match="ort_level"):
        compile_model(str(tiny_bert), tmp_path / "o", CompileOptions(target_options={"ort_level": "bogus"}))
    with pytest.raises(UsageError, match="--dim 'seq'"):
        compile_model(str(tiny_bert), tmp_path / "o", CompileOptions(dims={"seq": 16}))


def test_hf_cache_hit_skips_the_export(tiny_bert, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = compile_model(str(tiny_bert), tmp_path / "a", CompileOptions(cache_dir=str(cache)))
    assert first.cache == "miss" and first.manifest["parity"]["ok"]

    def boom(*_a, **_k):
        raise AssertionError("the export ran on a cache hit")

    monkeypatch.setattr("precast.compiler.frontends.hf_source.load_hf_folder", boom)
    monkeypatch.setattr("precast.compiler.frontends.torch_export.export_module", boom)
    hit = compile_model(str(tiny_bert), tmp_path / "b", CompileOptions(cache_dir=str(cache)))
    assert hit.cache == "hit"
    assert (tmp_path / "b" / "model.onnx").read_bytes() == (tmp_path / "a" / "model.onnx").read_bytes()
    assert hit.to_json()["artifact"]["files"] == first.files
    # Other options are another key: this one must build (and so reach the export)
    with pytest.raises(AssertionError, match="the export ran"):
        compile_model(str(tiny_bert), tmp_path / "c", CompileOptions(cache_dir=str(cache), atol=1e-3))


def test_changed_weights_are_a_cache_miss(tiny_bert, tmp_path):
    """The key hashes the folder's files: new weights under the same name must not hit."""
    import shutil

    folder = tmp_path / "tiny-bert"
    shutil.copytree(tiny_bert, folder)
    cache = str(tmp_path / "cache")
    compile_model(str(folder), tmp_path / "a", CompileOptions(cache_dir=cache))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the last weights' bytes (the header stays valid)
    weights.write_bytes(bytes(data))
    assert compile_model(str(folder), tmp_path / "b", CompileOptions(cache_dir=cache)).cache == "miss"


def test_report_json_comes_from_the_library(tiny_bert, tmp_path):
    from precast.compiler.report import CompileReport
    from precast.errors import ParityError

    e = ParityError("target 'ort-cpu': parity failed", {"ok": False, "inputs": {}, "outputs": {}})
    payload = CompileReport.failure_json(e)
    assert payload["exit_code"] == 2 and payload["error_type"] == "ParityError"
    assert "inputs" not in payload["parity"]
