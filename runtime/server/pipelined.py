"""A staged artifact served as a pipeline: the batcher's model whose ``run`` goes through a StagePipeline.

The batcher calls ``model.run(feeds)`` for each batch it collects. For a staged artifact (``split-stages``)
the host wraps the Model in ``PipelinedModel``: ``run`` submits the batch to the artifact's StagePipeline
(one worker and session per stage) and waits for it, and ServerState starts one batcher worker per stage,
so while one batch is in stage 1 the next is already in stage 0. ``--threads`` is each stage's budget
(default 1: the stages share the host's cores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["PipelinedModel", "pipelined_if_staged"]


class PipelinedModel:
    """A Model whose ``run`` goes through its StagePipeline; every other attribute is the Model's."""

    def __init__(self, model, pipeline):
        self._model = model
        self.pipeline = pipeline

    @property
    def stages(self) -> int:
        return len(self.pipeline.stages)

    def run(self, feeds: Mapping[str, object], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        return self.pipeline.run(feeds, outputs)

    def close(self) -> None:
        """Drain and join the pipeline's workers, then close the Model."""
        try:
            self.pipeline.close()
        finally:
            self._model.close()

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __repr__(self) -> str:
        return f"<precast.PipelinedModel {self._model.path} stages={self.stages}>"


def pipelined_if_staged(model):
    """``model`` wrapped in a PipelinedModel when its artifact is staged, else ``model`` itself. The pipeline
    shares the Model's stage sessions (one copy of the weights; their threads are ``load()``'s)."""
    if model.manifest.stages is None:
        return model
    try:
        return PipelinedModel(model, model.pipeline(threads=None))
    except BaseException:
        model.close()
        raise
