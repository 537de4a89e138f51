"""The speculative-decoding flags as the engine's config (speculative_options.py), and the counters' arithmetic
(metrics.SpecStats). No model."""

from __future__ import annotations

import pytest

from precast.errors import ArtifactError, UsageError
from precast.runtime.llm.metrics import EngineCounters, SpecStats
from precast.runtime.llm.speculative_options import SpeculativeOptions


def test_no_flag_no_speculation_and_draft_implies_the_method(tmp_path):
    assert SpeculativeOptions().config() is None
    cfg = SpeculativeOptions(draft=str(tmp_path)).config()
    assert (cfg.method, cfg.draft, cfg.num_tokens, cfg.adaptive) == ("draft", str(tmp_path), 4, True)
    cfg = SpeculativeOptions(speculative="ngram", num_speculative_tokens=7).config()
    assert (cfg.method, cfg.draft, cfg.num_tokens) == ("ngram", None, 7)


@pytest.mark.parametrize(
    "options, error, words",
    [
        (
            {"num_speculative_tokens": 2},
            UsageError,
            "--num-speculative-tokens needs --draft DIR or --speculative",
        ),
        ({"speculative": "draft"}, UsageError, "needs a draft artifact (--draft DIR)"),
        ({"speculative": "ngram", "draft": "."}, UsageError, "exclude each other"),
        ({"speculative": "ngram", "num_speculative_tokens": 17}, UsageError, "in [1, 16], got 17"),
        ({"speculative": "eagle"}, UsageError, "unknown speculative method 'eagle'"),
        ({"draft": "/nonexistent/draft"}, ArtifactError, "draft artifact not found: /nonexistent/draft"),
    ],
)
def test_bad_combinations_name_the_flag(options, error, words):
    with pytest.raises(error) as e:
        SpeculativeOptions(**options).config()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_spec_stats_between_two_snapshots():
    c = EngineCounters()
    assert SpecStats.of(c).acceptance_rate is None and SpecStats.of(c).tokens_per_step is None
    for kept in (0, 2, 4):
        c.observe_acceptance(kept)
    c.spec_proposed_tokens, c.spec_accepted_tokens = 12, 6
    before = c.snapshot()
    s = SpecStats.of(before)
    assert (s.proposed, s.accepted, s.verified_rows, s.accepted_per_row) == (12, 6, 3, (1, 0, 1, 0, 1))
    assert s.acceptance_rate == 0.5 and s.tokens_per_step == 3.0
    for kept in (4, 4):  # the next window: every draft kept
        c.observe_acceptance(kept)
    c.spec_proposed_tokens, c.spec_accepted_tokens = 20, 14
    w = SpecStats.of(c.snapshot(), since=before)
    assert (w.proposed, w.accepted, w.verified_rows, w.accepted_per_row) == (8, 8, 2, (0, 0, 0, 0, 2))
    assert w.acceptance_rate == 1.0 and w.tokens_per_step == 5.0
    assert w.as_dict()["tokens_per_step"] == 5.0 and w.as_dict()["accepted_per_row"] == [0, 0, 0, 0, 2]
