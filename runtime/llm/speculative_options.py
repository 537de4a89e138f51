"""The speculative-decoding flags of `precast serve`, `precast generate` and `precast bench`, declared once.

    --draft DIR                      a smaller causal-lm artifact with the target's tokenizer (implies draft)
    --speculative {draft,ngram}      ngram: prompt lookup, no second model
    --num-speculative-tokens K       the most tokens proposed per step (default 4)

``SpeculativeOptions.config()`` turns them into the engine's SpeculativeConfig (None: no speculation), or
one line naming the flag at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from precast.errors import ArtifactError, UsageError
from precast.options import opt
from precast.runtime.llm.speculative import MAX_SPEC_TOKENS, SpeculativeConfig

__all__ = ["DEFAULT_SPEC_TOKENS", "SPECULATIVE_OPTIONS", "SpeculativeOptions"]

DEFAULT_SPEC_TOKENS = SpeculativeConfig.num_tokens  # (4)


@dataclass(frozen=True)
class SpeculativeOptions:
    """Unset (None) everywhere: no speculation."""

    draft: str | None = opt(
        None,
        "Speculative decoding: a draft artifact, a smaller causal LM with the same tokenizer (implies "
        "--speculative draft).",
        parse=str,
        metavar="dir",
    )
    speculative: Literal["draft", "ngram"] | None = opt(
        None,
        "Speculative decoding: 'draft' (needs --draft) or 'ngram' (prompt lookup: proposes the tokens that "
        "followed the last few tokens' earlier occurrence in the prompt or output; no second model).",
    )
    num_speculative_tokens: int | None = opt(
        None,
        f"Speculative decoding: the most tokens proposed per step (default {DEFAULT_SPEC_TOKENS}).",
        min=1,
        max=MAX_SPEC_TOKENS,
    )

    @property
    def asked(self) -> bool:
        """Whether a flag asks for speculation (--draft or --speculative)."""
        return self.speculative is not None or self.draft is not None

    def config(self) -> SpeculativeConfig | None:
        """The engine's SpeculativeConfig, or None when no flag asks for speculation. UsageError for a
        combination that makes no sense, ArtifactError for a draft that is not there (as for the target)."""
        if not self.asked:
            if self.num_speculative_tokens is not None:
                raise UsageError("--num-speculative-tokens needs --draft DIR or --speculative ngram")
            return None
        k = self.num_speculative_tokens
        config = SpeculativeConfig(
            method=self.speculative or "draft",
            num_tokens=DEFAULT_SPEC_TOKENS if k is None else k,
            draft=None if self.draft is None else str(self.draft),
        ).validate()
        if config.draft is not None and not Path(config.draft).exists():
            raise ArtifactError(f"draft artifact not found: {config.draft} (--draft)")
        return config


# Their names, as `precast serve` hands them to the LLM engine (ServerConfig.llm)
SPECULATIVE_OPTIONS = ("draft", "speculative", "num_speculative_tokens")
