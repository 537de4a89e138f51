"""Hugging Face text tasks by head: a tiny BERT with each head, compiled with no --task (inferred from
config.architectures) -> the artifact's outputs match the model's own forward on fresh text, labels included.

All four heads are built and compiled once per module (~3 s each on 2 cores).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from precast.errors import UsageError
from tests.helpers import randomize_weights_

WORDS = (
    "the quick brown fox jumps over lazy dog a man is playing guitar on small stage while audience sings "
    "along interest rates were raised again to fight inflation how do i reset my password if no longer have "
    "access email account who where what plays ? . ,"
).split()
HEADS = {  # task -> (transformers class, id2label or None)
    "text-classification": ("BertForSequenceClassification", {0: "negative", 1: "neutral", 2: "positive"}),
    "token-classification": ("BertForTokenClassification", {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}),
    "question-answering": ("BertForQuestionAnswering", None),
    "fill-mask": ("BertForMaskedLM", None),
}


def _tokenizer():
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]
    return transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(words)})


def _tiny_bert(task: str, vocab_size: int):
    import torch
    import transformers

    cls, labels = HEADS[task]
    extra = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if labels else {}
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **extra,
    )
    torch.manual_seed(0)
    return randomize_weights_(getattr(transformers, cls)(config).eval())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """task -> (transformers model, tokenizer, hf folder, artifact): every head compiled once, no --task."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from precast.compiler.driver import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("text_tasks")
    tok = _tokenizer()
    out = {}
    for task in HEADS:
        folder = root / task / "hf"
        model = _tiny_bert(task, len(tok))
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        compile_model(str(folder), root / task / "art", CompileOptions())
        out[task] = (model, tok, folder, root / task / "art")
    assert len(tok) == 5 + len(set(WORDS)) and tok.unk_token_id not in tok("the lazy fox")["input_ids"]
    return out


def _fresh_feeds(task: str, tok) -> dict[str, np.ndarray]:
    """Text the verification did not use; padded rows of different lengths (QA: a context longer than the
    question, as a (question, context) pair)."""
    if task == "question-answering":
        questions = ["who plays guitar ?", "where is the dog ?"]
        contexts = [
            "a man is playing guitar on a small stage while the audience sings along .",
            "the quick brown fox jumps over the lazy dog .",
        ]
        enc = tok(questions, contexts, padding=True, return_tensors="np")
    else:
        text = ["the fox jumps .", "how do i reset my [MASK] if i have no email account ?", "a man plays ."]
        enc = tok(text, padding=True, return_tensors="np")
    return {k: v.astype(np.int64) for k, v in enc.items()}


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(HEADS))
def test_head_is_inferred_and_matches_transformers(compiled, task):
    import torch

    from precast.artifact.manifest import read_manifest
    from precast.runtime import load

    model, tok, folder, artifact = compiled[task]
    manifest = read_manifest(artifact)
    assert manifest.source["task"] == task and manifest.parity["ok"] is True
    config = json.loads((folder / "config.json").read_text())
    if HEADS[task][1] is not None:  # the labels travel, as config.json spells them
        assert manifest.source["id2label"] == config["id2label"]
    else:
        assert "id2label" not in manifest.source
    feeds = _fresh_feeds(task, tok)
    assert set(feeds) == {i.name for i in manifest.io.inputs}
    ours = load(artifact).run(feeds)
    with torch.no_grad():
        ref = model(**{n: torch.from_numpy(a) for n, a in feeds.items()})
    expected = {k: v.numpy() for k, v in ref.items() if isinstance(v, torch.Tensor)}
    assert set(ours) == set(expected), task
    for name, want in expected.items():
        err = float(np.abs(ours[name] - want).max())
        print(f"{task} {name}: max abs error {err:.2e}")
        assert ours[name].shape == want.shape and err < 1e-4 * max(float(np.abs(want).max()), 1.0)


def test_task_mistakes_are_one_line_usage_errors(tmp_path, cli):
    from precast.compiler.frontends.source import load_source

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(
        UsageError, match="unknown task 'summarise' .*fill-mask.*question-answering.*causal-lm"
    ):
        load_source(str(tmp_path), task="summarise")
    with pytest.raises(UsageError, match="task 'question-answering'.*BertModel.*no QuestionAnswering head"):
        load_source(str(tmp_path), task="question-answering")
    r = cli("compile", tmp_path, "--task", "text-classification", "-o", tmp_path / "o")
    last = r.err.strip().splitlines()[-1]
    assert r.code == 1 and last.startswith("error: ") and "no SequenceClassification head" in last, r.err


@pytest.mark.slow
def test_task_runner_answers_as_transformers_pipelines(compiled):
    """precast's own pre/postprocessing of text (runtime/tasks.py) against transformers' pipelines on the same
    model: labels, per-token entities with their character spans, the answer span of a context longer than the
    question, the masked word's candidates."""
    import torch
    import transformers

    from precast.runtime import load
    from precast.runtime.tasks import TaskRunner

    def pipe(task):
        model, tok, _, _ = compiled[task]
        return transformers.pipeline(task, model=model, tokenizer=tok, device="cpu")

    def runner(task):
        return TaskRunner.open(load(compiled[task][3]))

    texts = ["the quick fox plays guitar .", "how do i reset my password ?"]
    got = runner("text-classification").run(texts=texts, top_k=3)
    want = pipe("text-classification")(texts, top_k=3)
    for g, w in zip(got, want):
        assert [r["label"] for r in g] == [r["label"] for r in w]
        np.testing.assert_allclose([r["score"] for r in g], [r["score"] for r in w], atol=1e-5)

    got = runner("token-classification").run(texts=texts)
    want = pipe("token-classification")(texts, ignore_labels=[])
    for g, w in zip(got, want):
        assert [(r["entity"], r["start"], r["end"]) for r in g] == [
            (r["entity"], r["start"], r["end"]) for r in w
        ]
        np.testing.assert_allclose([r["score"] for r in g], [r["score"] for r in w], atol=1e-5)

    # transformers 5 has no question-answering pipeline: the span search, by brute force over HF's logits
    model, tok = compiled["question-answering"][:2]
    context = "a man is playing guitar on a small stage while the audience sings along ."
    for question in ("who plays guitar ?", "where is the dog ?"):
        (got,) = runner("question-answering").run(texts=[question], context=context)
        enc = tok(question, context, return_offsets_mapping=True)
        with torch.no_grad():
            out = model(**{k: torch.tensor([v]) for k, v in enc.items() if k != "offset_mapping"})
        ctx = [i for i, s in enumerate(enc.sequence_ids()) if s == 1]
        ps = np.exp(out.start_logits[0].numpy()[ctx])
        pe = np.exp(out.end_logits[0].numpy()[ctx])
        ps, pe = ps / ps.sum(), pe / pe.sum()
        score, i, j = max(
            (ps[a] * pe[b], a, b) for a in range(len(ctx)) for b in range(a, min(a + 15, len(ctx)))
        )
        start, end = enc["offset_mapping"][ctx[i]][0], enc["offset_mapping"][ctx[j]][1]
        assert (got["start"], got["end"], got["answer"]) == (start, end, context[start:end]), question
        assert abs(got["score"] - score) < 1e-5 and len(question) < len(context)

    (got,) = runner("fill-mask").run(texts=["how do i reset my [MASK] ?"], top_k=4)
    want = pipe("fill-mask")("how do i reset my [MASK] ?", top_k=4)
    assert [r["token"] for r in got[0]] == [r["token"] for r in want]
    np.testing.assert_allclose([r["score"] for r in got[0]], [r["score"] for r in want], atol=1e-5)


@pytest.mark.slow
def test_kserve_takes_text_for_text_classifiers(compiled):
    """A text classifier's KServe v2 'text' input (tokenized in the server's sandbox): labels and scores equal the
    runtime's; its logits are no embeddings (/v1/embeddings says where to go); a token classifier labels tokens."""
    from fastapi.testclient import TestClient

    from precast.runtime import load
    from precast.runtime.server import ServerConfig, create_app
    from precast.runtime.tasks import TaskRunner

    texts = ["the quick fox plays guitar .", "who plays ?"]
    art = compiled["text-classification"][3]
    want = TaskRunner.open(load(art)).run(texts=texts, top_k=2)
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}],
        "parameters": {"top_k": 2},
    }
    with TestClient(create_app(ServerConfig(art, model_name="sst", max_queue_delay_ms=0))) as c:
        r = c.post("/v2/models/sst/infer", json=body)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        assert out["label"]["data"] == [x["label"] for row in want for x in row]
        np.testing.assert_allclose(out["score"]["data"], [x["score"] for row in want for x in row], atol=1e-5)
        r = c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "not an embedder" in r.json()["error"]["message"]
        bad = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [""]}]}
        assert c.post("/v2/models/sst/infer", json=bad).status_code == 400
    art = compiled["token-classification"][3]
    want = TaskRunner.open(load(art)).run(texts=texts[:1])[0]
    body["inputs"][0].update(shape=[1], data=texts[:1])
    with TestClient(create_app(ServerConfig(art, model_name="ner", max_queue_delay_ms=0))) as c:
        out = {o["name"]: o for o in c.post("/v2/models/ner/infer", json=body).json()["outputs"]}
        labels = out["label"]["data"][1 : 1 + len(want)]  # [CLS] first, then the words' tokens
        assert labels == [x["entity"] for x in want]
