"""Quantizing a causal LM that has learned something: perplexity (precast eval), the compile-time
top1/ppl_delta budget, INT4 RTN vs GPTQ and INT8 dynamic on the tiny LM trained on the shipped text."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from precast.compiler.driver import CompileOptions, compile_model
from precast.compiler.frontends.source import load_source
from precast.errors import InputError, ParityError, UsageError
from precast.runtime.llm.perplexity import make_windows, perplexity_of_text
from tests.llm.trained_lm import texts, trained_lm_dir

WINDOW = 64  # the fixture's training length

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm():
    """(folder, exported Source, calibration text, held-out text); one export shared by every compile."""
    folder = trained_lm_dir()
    train, held = texts()
    return folder, load_source(str(folder), task="causal-lm"), train[:40_000], held


@pytest.fixture(scope="module")
def artifacts(lm, tmp_path_factory):
    _, source, calib, _ = lm
    root = tmp_path_factory.mktemp("qlm")
    out = {}
    for name, passes in [
        ("fp32", None),
        ("rtn", "default,quantize-int4{algo=rtn,block=32}"),
        ("gptq", "default,quantize-int4{algo=gptq,block=32}"),
        ("int8", "default,quantize-int8"),
    ]:
        opts = CompileOptions(
            passes=passes,
            task="causal-lm",
            calibration_text=calib,
            accuracy_budget="top1>=0.8,ppl_delta<=3" if passes else None,
        )
        out[name] = compile_model(source, root / name, opts)
    return out


def _ppl(path, text, **kw) -> float:
    return perplexity_of_text(path, text, **{"window": WINDOW, "batch": 64, **kw}).perplexity


def test_make_windows_score_every_token_once():
    for n, window, stride in [(10, 4, 4), (10, 4, 2), (11, 5, 3), (3, 8, 8), (100, 16, 1)]:
        wins = make_windows(n, window, stride)
        scored = [t for _, e, f in wins for t in range(f, e)]
        # Each token at most once, in order; with overlap (stride < window) every token after the first.
        # Without overlap a window's first token has no context and is not scored (Hugging Face's recipe).
        assert scored == sorted(set(scored)) and scored[-1] == n - 1, (n, window, stride)
        expected_gaps = set() if stride < window or n <= window else {b for b, _, _ in wins[1:]}
        assert set(range(1, n)) - set(scored) == expected_gaps, (n, window, stride)
        assert all(e - b <= window for b, e, _ in make_windows(n, window, stride))
    with pytest.raises(InputError, match="stride"):
        make_windows(10, 4, 5)


@pytest.mark.parametrize("stride", [WINDOW, 24])
def test_perplexity_equals_torch(lm, artifacts, stride):
    """precast eval's number == Hugging Face's sliding-window perplexity recipe on the same tokens."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    folder, _, _, held = lm
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(held).ids[:600]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for b, e, f in make_windows(len(ids), WINDOW, stride):
            x = torch.tensor([ids[b:e]])
            labels = x.clone()
            labels[:, : f - b] = -100  # HF shifts labels: position t's label is scored from logits t-1
            n = e - f
            nll += float(model(input_ids=x, labels=labels).loss) * n
            count += n
    expected = math.exp(nll / count)
    got = perplexity_of_text(artifacts["fp32"].output, held, window=WINDOW, stride=stride, max_tokens=600)
    assert (
        got.tokens == count == (599 if stride < WINDOW else 599 - 9)
    )  # without overlap window starts go unscored
    assert got.perplexity == pytest.approx(expected, rel=2e-4)
    assert 5 < got.perplexity < 200  # a model that learned something (vocabulary 1024)


def test_gptq_beats_rtn_on_heldout_perplexity(lm, artifacts):
    """Over the whole held-out split (~12.9k tokens): measured fp32 50.04, RTN +0.35, GPTQ +0.15, INT8 +0.05."""
    folder, _, _, held = lm
    ppl = {k: _ppl(artifacts[k].output, held) for k in ("fp32", "rtn", "gptq", "int8")}
    # The training script measured the same held-out perplexity with torch.
    assert ppl["fp32"] == pytest.approx(
        json.loads((folder / "training.json").read_text())["heldout_ppl"], rel=1e-4
    )
    d_rtn, d_gptq = ppl["rtn"] - ppl["fp32"], ppl["gptq"] - ppl["fp32"]
    assert 0 < d_gptq < d_rtn, ppl
    assert abs(ppl["int8"] - ppl["fp32"]) < d_rtn, ppl
    stats = {r.spec: r.stats for r in artifacts["gptq"].records["ort-cpu"]}
    gptq = next(s for k, s in stats.items() if k.startswith("quantize-int4"))
    assert gptq["calibration"] == "calibration-text" and gptq["quantized"] > 0 and gptq["kept_fp32"] == 0


def test_budget_metrics_recorded_on_text(artifacts):
    for name in ("rtn", "gptq", "int8"):
        budget = artifacts[name].manifest["parity"]["budget"]
        text = budget["metrics"]["logits@text"]
        assert budget["ok"] and "not_measured" not in budget
        assert text["top1"] >= 0.8 and text["tokens"] > 400
        assert text["ppl_delta"] == pytest.approx(text["ppl"] - text["ppl_reference"], abs=1e-5)
        assert "top1" not in budget["metrics"]["logits"]  # the text's top1 replaces the random sample step's
    a, b = (artifacts[k].manifest["parity"]["budget"]["metrics"]["logits@text"] for k in ("rtn", "gptq"))
    assert a["ppl_reference"] == b["ppl_reference"]
    assert (
        b["top1"] > a["top1"] and b["ppl_delta"] < a["ppl_delta"]
    )  # GPTQ keeps more of the fp32 predictions


def test_ppl_budget_exceeded_fails_without_artifact(lm, tmp_path):
    _, source, calib, _ = lm
    opts = CompileOptions(
        passes="default,quantize-int4{algo=rtn,block=128}",
        task="causal-lm",
        calibration_text=calib,
        accuracy_budget="ppl_delta<=0.0001",
    )
    with pytest.raises(
        ParityError, match=r"ppl_delta \S+ on output 'logits@text' misses ppl_delta<=0.0001 by \S+"
    ):
        compile_model(source, tmp_path / "a", opts)
    assert not (tmp_path / "a").exists()
    with pytest.raises(UsageError, match="ppl_delta, top1 of a causal-lm compile is measured on text"):
        compile_model(
            source,
            tmp_path / "b",
            CompileOptions(
                passes="default,quantize-int8", task="causal-lm", accuracy_budget="ppl_delta<=1,top1>=0.9"
            ),
        )
    assert not (tmp_path / "b").exists()


def test_eval_cli(lm, artifacts, tmp_path):
    _, _, _, held = lm
    (tmp_path / "held.txt").write_text(held, encoding="utf-8")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from precast.cli.main import main; main(sys.argv[1:])",
        "eval",
        str(artifacts["fp32"].output),
    ]
    ok = subprocess.run(
        cmd
        + [
            "--perplexity",
            str(tmp_path / "held.txt"),
            "--window",
            str(WINDOW),
            "--max-tokens",
            "300",
            "--json",
            "--report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out == json.loads((tmp_path / "r.json").read_text())
    assert out["tokens"] == 300 - 5 and out["perplexity"] == pytest.approx(
        _ppl(artifacts["fp32"].output, held, max_tokens=300)
    )
    (tmp_path / "empty.txt").write_text("  \n")
    for extra, msg in [
        (["--perplexity", str(tmp_path / "nope.txt")], "text file not found"),
        (["--perplexity", str(tmp_path / "empty.txt")], "is empty"),
        (
            ["--perplexity", str(tmp_path / "held.txt"), "--window", "100000"],
            "exceeds the model's max context",
        ),
        (["--perplexity", str(tmp_path / "held.txt"), "--stride", "0", "--window", "8"], "stride"),
    ]:
        bad = subprocess.run(cmd + extra, capture_output=True, text=True, check=False)
        assert bad.returncode == 1 and msg in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    not_llm = subprocess.run(
        [*cmd[:-1], str(tmp_path), "--perplexity", str(tmp_path / "held.txt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert not_llm.returncode != 0 and "Traceback" not in not_llm.stderr


def test_step_calibration_feeds_run_through_the_graph(lm):
    """The feeds GPTQ calibrates on are valid steps: the fp32 graph runs them and the logits are finite."""
    from precast.ir.llm_text import step_calibration_feeds
    from precast.ir.parity import io_signature, ort_run_model

    folder, source, calib, _ = lm
    feeds = step_calibration_feeds(calib[:4000], folder, io_signature(source.model)[0], seq=40, max_batches=2)
    assert len(feeds) == 2 and feeds[0]["input_ids"].shape == (1, 40)
    out = ort_run_model(source.model, feeds[0])
    assert np.isfinite(out["logits"]).all() and out["logits"].shape == (1, source.info["llm"]["vocab"])
