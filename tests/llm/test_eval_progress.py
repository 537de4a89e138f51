"""`precast eval --perplexity` reports its steps and each window; -q and --json keep stderr / stdout clean."""

import json

from precast.runtime.llm.perplexity import perplexity_of_text
from tests.fake_progress import RecordingProgress

TEXT = "The quick brown fox jumps over the lazy dog. " * 20


def test_perplexity_of_text_reports_steps_and_windows(llm_artifact):
    rec = RecordingProgress()
    result = perplexity_of_text(llm_artifact, TEXT, window=32, max_tokens=100, batch=2, progress=rec)
    assert rec.steps[:2] == [f"loading {llm_artifact}", f"tokenizing {len(TEXT)} characters"]
    assert rec.steps[2] == f"scoring 100 tokens in {result.windows} windows of 32 (stride 32)"
    got = rec.advances("scoring")
    assert got[-1][0] == got[-1][1] == len(got)  # one advance per runner step, ending at the total
    labels = list(dict.fromkeys(w for _, _, w in got))
    assert labels[0] == f"windows 1-2 of {result.windows}" and len(labels) == -(-result.windows // 2)


def test_eval_cli_quiet_and_json(cli, llm_artifact, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    args = ("eval", llm_artifact, "--perplexity", tmp_path / "t.txt", "--window", "32")
    r = cli(*args, "--max-tokens", "100", "--json")
    assert r.code == 0 and r.err == "" and json.loads(r.out)["tokens"] > 0
    r = cli(*args, "--max-tokens", "100", "-q")
    assert r.code == 0 and r.out.startswith("perplexity ") and "•" not in r.err
