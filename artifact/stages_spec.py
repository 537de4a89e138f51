"""The manifest's ``stages`` block: a model cut into consecutive pipeline stages (the ``split-stages`` pass).

A staged artifact holds one model file per stage instead of one ``model.onnx`` (the target block then names
no ``model``); stage k reads the model's inputs it needs plus the boundary tensors stage k-1 produced. A
boundary tensor a later stage needs is passed through the stages between (listed as their input and output),
so stage k+1 needs nothing from before stage k. A model output is an output of the stage that computes it
(for an encoder, the last). Running the stages in order gives the unsplit model's outputs
(``runtime/staged/session.py``); ``runtime/staged/pipeline.py`` runs them as a pipeline (one worker per stage,
bounded queues between them).

    {"stages": {"n": 2, "by": "bytes",
                "stages": [{"model": "stages/stage_0.onnx", "inputs": ["input_ids", ...],
                            "outputs": ["h_3"], "bytes": 45000000, "layers": [0, 3]},
                           {"model": "stages/stage_1.onnx", "inputs": ["h_3", "attention_mask"],
                            "outputs": ["last_hidden_state"], "bytes": 46000000, "layers": [3, 6]}]}}

``layers`` is the half-open range of the source's layers a stage holds (informational). For a causal LM
(``llm`` block present), ``kv_layers`` lists the layers whose KV inputs/outputs the stage owns: the runner
feeds a stage only its own layers' KV. ``time_ms`` is the profiled time when ``by`` is ``time``.
"""

from __future__ import annotations

from dataclasses import dataclass

from precast.artifact.schema import Record
from precast.errors import ArtifactError

__all__ = ["StageEntry", "StagesSpec", "SPLIT_BY"]

SPLIT_BY = ("bytes", "time")


@dataclass(frozen=True)
class StageEntry(Record):
    """One stage: its model file (relative to the artifact), the tensors it reads and writes, its weight
    bytes, and (optional) the layer range it holds, the layers whose KV it owns and its profiled time."""

    model: str
    inputs: list[str]
    outputs: list[str]
    bytes: int
    layers: list[int] | None = None
    kv_layers: list[int] | None = None
    time_ms: float | None = None

    def validate(self, where: str) -> None:
        if self.bytes < 0:
            raise ArtifactError(f"{where}: stage '{self.model}': 'bytes' must be >= 0, got {self.bytes}")
        if self.layers is not None and (len(self.layers) != 2 or not 0 <= self.layers[0] <= self.layers[1]):
            raise ArtifactError(f"{where}: stage '{self.model}': 'layers' must be [first, end), got {self.layers}")
        if not self.outputs:
            raise ArtifactError(f"{where}: stage '{self.model}' has no outputs")


@dataclass(frozen=True)
class StagesSpec(Record):
    """The ``stages`` block: ``n`` stages in order, cut ``by`` weight bytes or profiled time."""

    n: int
    by: str
    stages: list[StageEntry]

    @classmethod
    def from_json(cls, obj: object, where: str = "artifact", path: str = "") -> StagesSpec:
        """``where``: the file; errors say "<where>: stages block: ..."."""
        return super().from_json(obj, f"{where}: stages block", path)

    @classmethod
    def field_parser(cls, name: str):
        if name == "stages":
            return _parse_entries
        return None

    def validate(self, where: str) -> None:
        if self.by not in SPLIT_BY:
            raise ArtifactError(f"{where}: 'by' must be one of {', '.join(SPLIT_BY)}, got '{self.by}'")
        if self.n < 2 or self.n != len(self.stages):
            raise ArtifactError(f"{where}: 'n' is {self.n} but the block lists {len(self.stages)} stages (need >= 2)")
        produced: set[str] = set()
        for k, stage in enumerate(self.stages):
            if k > 0:
                fed = [name for name in stage.inputs if name in produced]
                if not fed:
                    raise ArtifactError(f"{where}: stage {k} ('{stage.model}') reads nothing stage {k - 1} produced")
            produced |= set(stage.outputs)

    @property
    def boundaries(self) -> list[list[str]]:
        """Per cut k (between stage k and k+1): the tensors that cross it."""
        out = []
        for k in range(len(self.stages) - 1):
            later = {name for stage in self.stages[k + 1 :] for name in stage.inputs}
            out.append([name for name in self.stages[k].outputs if name in later])
        return out


def _parse_entries(obj: object, where: str) -> list[StageEntry]:
    if not isinstance(obj, list) or not obj:
        raise ArtifactError(f"{where}: 'stages' must be a non-empty list of stage objects")
    return [StageEntry.from_json(entry, where, f"stages[{k}].") for k, entry in enumerate(obj)]
