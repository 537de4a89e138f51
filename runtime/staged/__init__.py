"""Staged execution: a split-stages artifact's stages in order (``session``), concurrently (``pipeline``),
on one worker thread per stage (``stage_pool``, also the staged LLM runners')."""
