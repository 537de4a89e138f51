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

import numpy as np
import triton_python_backend_utils as pb_utils


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        from precast.artifact.manifest import read_manifest, sha256_file
        from precast.errors import ArtifactError, IntegrityError
        from precast.runtime.backends import create_session
        from precast.runtime.triton_python import StubConfig, drop_pycache

        config = StubConfig.from_args(args)
        artifact = config.artifact
        self.max_batch_size = config.max_batch_size
        drop_pycache(__file__)  # (what the stub's import of this file wrote beside it)
        manifest = read_manifest(artifact)
        k = int(config.params.get("precast_stage", "-1"))
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
        self.session = create_session(artifact, target, threads=config.threads)

    # Requests of one dynamic batch run as one call when their shapes allow (as the whole-model python model);
    # a request's error is its own response: a merged call that fails is rerun request by request.
    def execute(self, requests):
        from precast.runtime.triton_python import request_feeds, run_requests

        where = f"stage '{self.stage.model}'"
        feeds = request_feeds(requests, self.stage.inputs, pb_utils.get_input_tensor_by_name, f"{where}: ")
        results = run_requests(
            feeds, self._run, batched=self.max_batch_size > 0, blame=lambda e: _rejected(where, e)
        )
        return [self._response(r) for r in results]

    def _run(self, feeds):
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))

    def _response(self, outputs):
        if isinstance(outputs, Exception):
            return _error(str(outputs))
        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.session = None


def _rejected(where: str, e: Exception) -> Exception:
    from precast.errors import InputError, first_line

    return InputError(f"{where} rejected the request: {first_line(e, with_type=True)}")
