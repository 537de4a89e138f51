"""Encoder-decoder text models (T5, BART, Marian: tiny N(0, 0.1) folders with the real vocab sizes and generation
configs) compile with no --task, and the engine's tokens equal transformers' generate(): greedy 32 tokens and
4 beams (sequences, order and scores), for sources of different lengths served together."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from precast.compiler.driver import CompileOptions, compile_model  # noqa: E402
from precast.errors import ArtifactError, InputError, UsageError  # noqa: E402
from precast.runtime.seq2seq.engine import Seq2SeqEngine  # noqa: E402
from tests.seq2seq_models import make_folder  # noqa: E402

KINDS = ("t5", "bart", "marian")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        folder = make_folder(kind, root / "model", seed=KINDS.index(kind))
        report = compile_model(str(folder), str(root / "out"), CompileOptions())  # no task: inferred
        hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(
            str(folder), attn_implementation="eager"
        ).eval()
        out[kind] = (root / "out", hf, report)
    transformers.utils.logging.set_verbosity_error()
    return out


def _sources(hf, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    eos = hf.generation_config.eos_token_id
    return [[int(x) for x in rng.integers(5, 20000, n)] + [eos] for n in (14, 6, 9)]


def _padded(seqs: list[list[int]], fill: int) -> list[list[int]]:
    n = max(map(len, seqs))
    return [s + [fill] * (n - len(s)) for s in seqs]


@pytest.mark.parametrize("kind", KINDS)
def test_compiles_without_task_and_is_checked_end_to_end(built, kind):
    out, _hf, report = built[kind]
    spec = json.loads((out / "seq2seq.json").read_text())
    assert spec["task"] == "text2text-generation" and spec["model_type"] == kind
    assert spec["vocab"] == {"t5": 32128, "bart": 50265, "marian": 58101}[kind]
    assert spec["parity"]["encoder"]["ok"] and spec["parity"]["decoder"]["ok"]
    assert spec["parity"]["generate"] == {"ok": True, "sources": 3, "tokens": 48, "identical": True}
    assert (out / "encoder" / "manifest.json").is_file() and (out / "decoder" / "manifest.json").is_file()
    assert report.manifest["task"] == "text2text-generation"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_matches_generate(built, kind):
    out, hf, _ = built[kind]
    engine = Seq2SeqEngine.load(out)
    sources = _sources(hf)
    results = engine.generate(sources, num_beams=1, max_new_tokens=32)  # one batch, three lengths
    assert engine.pool.num_used == 0  # every block back
    for src, res in zip(sources, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), num_beams=1, max_new_tokens=32)[0].tolist()
        assert res.sequences[0] == ref
        assert len(res.tokens) == 32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("penalty, early", [(1.0, True), (2.0, False)])
def test_beam_search_matches_generate(built, kind, penalty, early):
    out, hf, _ = built[kind]
    engine = Seq2SeqEngine.load(out)
    sources = _sources(hf, seed=2)
    kw = dict(
        num_beams=4, num_return_sequences=4, max_new_tokens=24, length_penalty=penalty, early_stopping=early
    )
    results = engine.generate(sources, **kw)
    assert engine.pool.num_used == 0
    for src, res in zip(sources, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([src]), output_scores=True, return_dict_in_generate=True, **kw)
        assert _padded(res.sequences, engine.settings.beam_fill_token_id) == ref.sequences.tolist()
        np.testing.assert_allclose(res.scores, ref.sequences_scores.numpy(), rtol=0, atol=2e-5)


def test_default_beams_come_from_the_generation_config(built):
    out, hf, _ = built["bart"]
    engine = Seq2SeqEngine.load(out)
    assert engine.settings.num_beams == 4  # bart-base's generation_config
    src = _sources(hf)[0]
    [res] = engine.generate([src], max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([src]), max_new_tokens=12)[0].tolist()
    assert res.sequences[0] == ref


def test_submitted_requests_batch_and_cancel(built):
    out, hf, _ = built["t5"]
    engine = Seq2SeqEngine.load(out)
    try:
        srcs = _sources(hf, seed=3)
        handles = [engine.submit(s, max_new_tokens=16) for s in srcs]
        victim = engine.submit(srcs[0], max_new_tokens=200)
        victim.cancel()
        got = [h.result(timeout=60) for h in handles]
        with pytest.raises(InputError, match="cancelled"):
            victim.result(timeout=60)
        want = engine.generate(srcs, max_new_tokens=16)
        assert [g.sequences for g in got] == [w.sequences for w in want]
    finally:
        engine.close()
    assert engine.pool.num_used == 0 and engine.cross_bytes == 0


def test_bad_requests_are_named(built):
    out, _hf, _ = built["t5"]
    engine = Seq2SeqEngine.load(out)
    with pytest.raises(UsageError, match="unknown generation option 'beams'"):
        engine.generate([[5, 6, 1]], beams=2)
    with pytest.raises(InputError, match="token ids"):
        engine.generate([[5, 10**9]])
    with pytest.raises(InputError, match="empty source"):
        engine.generate([[]])
    with pytest.raises(UsageError, match="language applies to Whisper"):
        engine.generate([[5, 1]], language="en")
    for bad in (["a", "b"], None, 5, np.array([[1, 2, 3]])):
        with pytest.raises(InputError, match="a source must be a text or a 1-D list of integer token ids"):
            engine.generate([bad])
    with pytest.raises(InputError, match="empty source text"):
        engine.generate(["  "])
    with pytest.raises(InputError, match="max_new_tokens / max_length: .*at most 511 new tokens"):
        engine.generate([[5, 1]], max_new_tokens=10**5)
    engine.close()
    with pytest.raises(UsageError, match="the engine is closed"):
        engine.generate([[5, 1]])


def test_tampered_artifact_is_refused(built, tmp_path):
    import shutil

    out, _hf, _ = built["marian"]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    from precast.runtime.verify import verify_artifact

    reports = verify_artifact(copy)  # `precast verify`: the listed files, then each part's parity re-run
    assert sorted(reports) == ["decoder:ort-cpu", "encoder:ort-cpu"] and all(
        r["ok"] for r in reports.values()
    )
    gen = copy / "tokenizer" / "generation_config.json"
    gen.write_text(gen.read_text().replace('"num_beams": 4', '"num_beams": 1'))
    with pytest.raises(ArtifactError, match="generation_config.json does not match its sha256"):
        Seq2SeqEngine.load(copy)
    with pytest.raises(ArtifactError, match="generation_config.json does not match its sha256"):
        verify_artifact(copy)
    spec = json.loads((out / "seq2seq.json").read_text())
    shutil.copyfile(out / "tokenizer" / "generation_config.json", gen)  # (back as compiled)
    (copy / "seq2seq.json").write_text(json.dumps({**spec, "heads": spec["heads"] // 2}))
    with pytest.raises(ArtifactError, match="does not match the decoder graph: heads="):
        Seq2SeqEngine.load(copy)
    spec["files"]["../../etc/passwd"] = "0" * 64
    (copy / "seq2seq.json").write_text(json.dumps(spec))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        Seq2SeqEngine.load(copy)


def test_cli_run_text(built):
    out, _hf, _ = built["t5"]
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from precast.cli.main import main; main()",
            "run",
            str(out),
            "--text",
            "hello",
            "--text",
            "a longer text",
            "--max-new-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [r["input"] for r in rows] == ["hello", "a longer text"] and all(
        len(r["tokens"]) == 5 for r in rows
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            "from precast.cli.main import main; main()",
            "run",
            str(out),
            "--audio",
            "x.wav",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1 and "give --text TEXT" in bad.stderr


def test_runtime_load_points_at_the_engine(built):
    import precast.runtime as rt

    out, _hf, _ = built["bart"]
    with pytest.raises(UsageError, match="encoder-decoder artifact .*Seq2SeqEngine.load"):
        rt.load(out)


def test_recompiling_replaces_a_seq2seq_artifact_but_not_a_foreign_folder(built, tmp_path):
    from precast.compiler.artifact import check_replaceable

    out, _hf, _ = built["t5"]
    check_replaceable(out)  # a compile into the same -o may replace it
    foreign = tmp_path / "foreign"
    import shutil

    shutil.copytree(out, foreign)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        check_replaceable(foreign)


def test_streaming_and_priorities(built):
    out, hf, _ = built["t5"]
    engine = Seq2SeqEngine.load(out)
    try:
        srcs = _sources(hf, seed=4)
        streamed = list(engine.submit(srcs[0], max_new_tokens=12).stream(timeout=60))
        [whole] = engine.generate([srcs[0]], max_new_tokens=12)
        assert streamed == whole.tokens and len(streamed) == 12
        beams = engine.submit(srcs[1], max_new_tokens=8, num_beams=3)
        assert list(beams.stream(timeout=60)) == beams.result().tokens
        with pytest.raises(UsageError, match="priority must be an integer"):
            engine.submit(srcs[0], priority="high")
    finally:
        engine.close()
    # a pool of one block: one request at a time, so the waiting queue's order shows in when each one ends
    engine = Seq2SeqEngine.load(out, num_blocks=1)
    try:
        with engine._cond:  # (the loop waits for the lock: all three are queued before its first step)
            low = engine.submit(srcs[0], max_new_tokens=4, priority=5)
            high = engine.submit(srcs[1], max_new_tokens=4, priority=-1)
            mid = engine.submit(srcs[2], max_new_tokens=4, priority=0)
        ends = [h.result(timeout=60) and h._req.finished_step for h in (high, mid, low)]
        assert ends == sorted(ends) and len(set(ends)) == 3, ends
        done = engine.submit(srcs[0], max_new_tokens=2)
        done.result(timeout=60)
        done.cancel()  # after the end: the result stands
        assert len(done.result().tokens) == 2
    finally:
        engine.close()


def test_output_inside_a_seq2seq_artifact_is_refused_before_the_export(built):
    out, _hf, _ = built["bart"]
    with pytest.raises(UsageError, match="inside the artifact"):
        compile_model(str(out.parent / "model"), str(out / "encoder"), CompileOptions())
    with pytest.raises(UsageError, match="its task is text2text-generation"):
        compile_model(
            str(out.parent / "model"), str(out.parent / "x"), CompileOptions(task="text-classification")
        )


@pytest.mark.parametrize("kind", KINDS)
def test_beams_that_end_at_different_lengths_match_generate(built, kind):
    """Random models rarely say EOS: the EOS here is a token the model's own greedy output repeats, so the beams
    end at different steps (hypotheses finished, early-stopping heuristics, padding of short ones)."""
    out, hf, _ = built[kind]
    engine = Seq2SeqEngine.load(out)
    sources = _sources(hf)
    greedy = engine.generate(sources, num_beams=1, max_new_tokens=16)
    seen = [tok for r in greedy for tok in r.tokens[1:12]]
    lengths: set[int] = set()
    for eos in sorted(set(seen), key=lambda t: (-seen.count(t), t))[:4]:  # until some beams end early
        kw = dict(
            num_beams=4, num_return_sequences=4, max_new_tokens=24, eos_token_id=eos, early_stopping=False
        )
        results = engine.generate(sources, **kw)
        fill = engine.settings.with_overrides(eos_token_id=eos).beam_fill_token_id
        lengths = set()
        for src, res in zip(sources, results):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([src]), output_scores=True, return_dict_in_generate=True, **kw)
            assert _padded(res.sequences, fill) == ref.sequences.tolist()
            np.testing.assert_allclose(res.scores, ref.sequences_scores.numpy(), rtol=0, atol=2e-5)
            lengths |= {len(s) for s in res.sequences}
        if len(lengths) > 1:
            break
    assert len(lengths) > 1  # (some hypotheses ended before others: the test exercises what it says)
    assert engine.pool.num_used == 0
