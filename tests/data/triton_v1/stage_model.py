"""Triton Python-backend model running one stage of a staged precast artifact (copied to
``<name>_stage_<k>/1/model.py``; the ensemble ``<name>`` chains the stage models).

Written by precast's ``triton`` target for a model compiled with ``split-stages``. It runs inside Triton's
Python stub, which must be able to import ``precast.runtime`` (numpy + onnxruntime): the stub embeds the
first ``python3`` on tritonserver's PATH, so install precast into that environment. The stage's ONNX file
sits beside this one (``model.onnx``), and is the file the artifact's manifest lists for the stage, so
``precast.runtime.load`` (and the compile's verification) run the very files Triton serves.

Config parameters (config.pbtxt):
  precast_artifact   the artifact directory, absolute or relative to this model's directory
                     (default "../..": the artifact that holds this model repository)
  precast_stage      the stage's index in the manifest's ``stages`` block
  precast_threads    intra-op threads of the stage's session (0 = the artifact's setting)
"""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class TritonPythonModel:
    def initialize(self, args):
        from precast.runtime.backends import create_session
        from precast.runtime.errors import ArtifactError, IntegrityError
        from precast.runtime.manifest import read_manifest, sha256_file

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        artifact = Path(params.get("precast_artifact") or "../..")
        if not artifact.is_absolute():
            artifact = (Path(args["model_repository"]) / artifact).resolve()
        self.max_batch_size = int(config.get("max_batch_size", 0))
        threads = int(params.get("precast_threads") or 0) or None
        # The stub's import of this file wrote __pycache__ beside it (it ignores PYTHONDONTWRITEBYTECODE):
        # remove it so the artifact stays exactly what its manifest lists (precast.runtime.load checks).
        shutil.rmtree(Path(__file__).resolve().parent / "__pycache__", ignore_errors=True)
        manifest = read_manifest(artifact)
        k = int(params.get("precast_stage", "-1"))
        stages = manifest.stages.stages if manifest.stages is not None else []
        if not 0 <= k < len(stages):
            raise ArtifactError(f"artifact {artifact}: no stage {k} in its manifest ({len(stages)} stages)")
        self.stage = stages[k]
        # A tensor the stage passes through to a later one is not its Triton output (the ensemble has it).
        self.outputs = [n for n in self.stage.outputs if n not in self.stage.inputs]
        # Hash what this stage reads (its model file and external data), not the other stages' weights.
        folder = self.stage.model.rsplit("/", 1)[0] + "/"
        for rel, digest in sorted(manifest.files.items()):
            if rel.startswith(folder):
                if sha256_file(artifact / rel) != digest:
                    raise IntegrityError(f"artifact {artifact}: file '{rel}' is missing or was modified")
        target = dataclasses.replace(manifest.target, model=self.stage.model)
        self.session = create_session(artifact, target, threads=threads)

    # Requests of one dynamic batch run as one call when their shapes allow (as the whole-model python model).
    def execute(self, requests):
        responses = [None] * len(requests)
        groups = {}  # (per-input dtype and shape past the batch dim) -> [(request index, feeds)]
        for i, request in enumerate(requests):
            feeds = {}
            for name in self.stage.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is None:
                    responses[i] = _error(f"stage '{self.stage.model}': missing input '{name}'")
                    break
                feeds[name] = tensor.as_numpy()
            if responses[i] is None:
                batched = self.max_batch_size > 0 and all(a.ndim >= 1 for a in feeds.values())
                key = tuple((n, a.dtype.str, a.shape[1:]) for n, a in feeds.items()) if batched else i
                groups.setdefault(key, []).append((i, feeds))
        for members in groups.values():
            self._run_group(members, responses)
        return responses

    def _run(self, feeds):
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))

    def _run_group(self, members, responses):
        if len(members) > 1:
            sizes = [next(iter(f.values())).shape[0] for _, f in members]
            feeds = {n: np.concatenate([f[n] for _, f in members]) for n in self.stage.inputs}
            try:
                outputs = self._run(feeds)
            except Exception:  # noqa: BLE001 - one bad request: run them one by one so only it fails
                outputs = None
            if outputs is not None:
                starts = np.cumsum([0] + sizes)
                for (i, _), a, b in zip(members, starts[:-1], starts[1:]):
                    responses[i] = self._response({n: v[a:b] for n, v in outputs.items()})
                return
        for i, feeds in members:
            try:
                responses[i] = self._response(self._run(feeds))
            except Exception as e:  # noqa: BLE001 - the request's error, not the model's
                responses[i] = _error(f"stage '{self.stage.model}' rejected the request: {_first_line(e)}")

    def _response(self, outputs):
        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.session = None
