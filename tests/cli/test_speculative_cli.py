"""Speculative decoding from the command line: `precast generate` / `bench` / `serve` with --draft,
--speculative ngram and --num-speculative-tokens, over a real compiled tiny Llama and a draft of it."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.slow

PROMPT = "def wrap(text, width=70):"


def _generate(cli, artifact, *flags):
    r = cli("generate", artifact, PROMPT, "--max-tokens", 24, "--json", *flags)
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_generate_speculates_and_keeps_the_greedy_text(cli, llm_artifact, llm_draft_artifact):
    plain = _generate(cli, llm_artifact)
    assert "speculative" not in plain
    # a draft with other weights: most proposals rejected, the text is still the target's
    other = _generate(cli, llm_artifact, "--draft", llm_draft_artifact, "--num-speculative-tokens", 3)
    assert other["text"] == plain["text"] and other["token_ids"] == plain["token_ids"]
    s = other["speculative"]
    assert (s["method"], s["num_tokens"], s["draft"]) == ("draft", 3, str(llm_draft_artifact))
    assert s["proposed_tokens"] > 0 and s["verified_rows"] == sum(s["accepted_per_row"]) > 0
    assert s["acceptance_rate"] == s["accepted_tokens"] / s["proposed_tokens"]
    # the target as its own draft: every greedy proposal kept, 1 + 4 tokens per verified step
    same = _generate(cli, llm_artifact, "--draft", llm_artifact)
    assert same["text"] == plain["text"]
    s = same["speculative"]
    assert s["accepted_tokens"] == s["proposed_tokens"] > 0 and s["acceptance_rate"] == 1.0
    assert s["tokens_per_step"] > 2 and s["accepted_per_row"][-1] > 0 and len(s["accepted_per_row"]) == 5
    assert same["metrics"]["spec_proposed_tokens"] == s["proposed_tokens"]
    assert same["metrics"]["steps"] < plain["metrics"]["steps"]
    # prompt lookup, no second model
    ngram = _generate(cli, llm_artifact, "--speculative", "ngram")
    assert ngram["text"] == plain["text"] and ngram["speculative"]["method"] == "ngram"
    assert ngram["speculative"]["draft"] is None


def test_generate_summary_line_names_the_acceptance(cli, llm_artifact):
    r = cli("generate", llm_artifact, PROMPT, "--max-tokens", 12, "--draft", llm_artifact)
    assert r.code == 0, r.err
    assert "speculative draft: " in r.err and "drafts accepted (100%)" in r.err
    assert "tokens per verified step" in r.err


@pytest.fixture(scope="module")
def foreign_tokenizer_draft(llm_draft_artifact, tmp_path_factory):
    """llm_draft_artifact with two of its tokenizer's ids swapped (its manifest re-hashed): a draft whose
    tokenizer differs from the target's."""
    from precast.artifact.manifest import dump_json, sha256_file

    out = tmp_path_factory.mktemp("foreign") / "draft"
    shutil.copytree(llm_draft_artifact, out)
    path = out / "tokenizer" / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = sha256_file(path)
    dump_json(manifest, out / "manifest.json")
    return out


def _one_line(r, code: int, *words: str) -> None:
    assert r.code == code, (r.code, r.err)
    assert r.err.count("\n") == 1 and r.err.startswith("error: ") and "Traceback" not in r.err, r.err
    for w in words:
        assert w in r.err, (w, r.err)


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_bad_speculative_flags_are_one_line_errors(cli, llm_artifact, llm_draft_artifact, tmp_path, command):
    head = {
        "generate": ["generate", llm_artifact, PROMPT, "--max-tokens", 4],
        "bench": ["bench", llm_artifact, "--requests", 1, "--output-len", 4, "--prompt-len", 4],
        "serve": ["serve", llm_artifact, "--port", 0],
    }[command]
    cases = [
        (["--speculative", "ngram", "--draft", llm_draft_artifact], 1, "exclude each other"),
        (["--speculative", "draft"], 1, "needs a draft artifact (--draft DIR)"),
        (
            ["--num-speculative-tokens", 3],
            1,
            "--num-speculative-tokens needs --draft DIR or --speculative ngram",
        ),
        (["--draft", llm_draft_artifact, "--num-speculative-tokens", 0], 1, "--num-speculative-tokens"),
        (["--speculative", "ngram", "--num-speculative-tokens", 17], 1, "1<=x<=16"),
        (["--speculative", "medusa"], 1, "'medusa' is not one of 'draft', 'ngram'"),
        (["--draft", tmp_path / "missing"], 3, "draft artifact not found", "missing"),
    ]
    for flags, code, *words in cases:
        _one_line(cli(*head, *flags), code, *words)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_draft_with_another_tokenizer_is_refused_at_load(
    cli, llm_artifact, foreign_tokenizer_draft, command
):
    head = (
        ["generate", llm_artifact, PROMPT] if command == "generate" else ["serve", llm_artifact, "--port", 0]
    )
    r = cli(*head, "--draft", foreign_tokenizer_draft)
    _one_line(r, 1, "its tokenizer differs from the target's", str(foreign_tokenizer_draft))


def test_speculative_flags_on_a_model_that_is_no_llm(cli, tmp_path):
    pytest.importorskip("fastapi")
    from tests.helpers import tiny_mlp
    from tests.server.conftest import compile_tiny

    mlp = compile_tiny(tiny_mlp(seed=0), tmp_path / "mlp")
    _one_line(cli("bench", mlp, "--requests", 1, "--speculative", "ngram"), 1, "not a causal-lm artifact")
    _one_line(
        cli("serve", mlp, "--port", 0, "--speculative", "ngram"),
        1,
        "LLM options (speculative) given, but it is not an LLM artifact",
    )


def test_bench_reports_acceptance_and_tokens_per_step(cli, llm_artifact):
    args = ["--concurrency", "1", "--requests", 2, "--prompt-len", 8, "--output-len", 24, "--warmup", "0"]
    r = cli("bench", llm_artifact, *args, "--draft", llm_artifact, "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["llm"]["speculative"] == "draft" and report["llm"]["num_speculative_tokens"] == 4
    assert report["llm"]["draft"] == str(llm_artifact)
    (level,) = report["levels"]
    assert level["spec_acceptance_rate"] == 1.0 and level["spec_tokens_per_step"] > 2
    assert level["spec_accepted_tokens"] == level["spec_proposed_tokens"] > 0
    r = cli("bench", llm_artifact, *args, "--speculative", "ngram", "--num-speculative-tokens", 2)
    assert r.code == 0, r.err
    assert "accepted %" in r.out and "tokens/step" in r.out and "ngram (prompt lookup)" in r.out
    plain = cli("bench", llm_artifact, *args, "--json")
    assert plain.code == 0 and json.loads(plain.out)["llm"]["speculative"] is None
    assert json.loads(plain.out)["levels"][0]["spec_acceptance_rate"] is None
    # against a server, its own flags decide
    _one_line(
        cli("bench", llm_artifact, *args, "--url", "http://127.0.0.1:9", "--speculative", "ngram"),
        1,
        "with --url the server's own flags decide",
    )
