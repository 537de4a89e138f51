"""Triton Python-backend model serving a precast artifact (copied to ``<name>_precast/1/model.py``).

Written by precast's ``triton`` target; it runs inside Triton's Python stub, which must be able to
import ``precast.runtime`` (numpy + onnxruntime, and ``tokenizers`` for LLMs): the stub embeds the
first ``python3`` on tritonserver's PATH, so install precast into that environment.

Config parameters (config.pbtxt):
  precast_artifact   the artifact directory, absolute or relative to this model's directory
                     (default "../..": the artifact that holds this model repository)
  precast_mode       "tensor" (run the artifact on batched tensors) or "llm" (decoupled: the precast
                     Engine streams one response per generated token, text in / text out)
  precast_threads    intra-op threads of the artifact's session (0 = onnxruntime's default)
  precast_num_blocks KV blocks of the LLM engine's pool (0 = the engine's default)
"""

import json
import shutil
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _verify(root: Path) -> None:
    """sha256 of every file the manifest lists. (precast.runtime.load(verify=True) also refuses unlisted
    files, and another instance's stub may be writing __pycache__ beside this file right now.)"""
    from precast.runtime.errors import IntegrityError
    from precast.runtime.manifest import read_manifest, sha256_file

    for rel, digest in sorted(read_manifest(root)["files"].items()):
        path = root / rel
        if not path.is_file() or sha256_file(path) != digest:
            raise IntegrityError(f"artifact {root}: file '{rel}' is missing or was modified")


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        artifact = Path(params.get("precast_artifact") or "../..")
        if not artifact.is_absolute():
            artifact = (Path(args["model_repository"]) / artifact).resolve()
        self.artifact = artifact
        self.mode = params.get("precast_mode") or "tensor"
        self.max_batch_size = int(config.get("max_batch_size", 0))
        threads = int(params.get("precast_threads") or 0) or None
        # The stub's import of this file wrote __pycache__ beside it (it ignores PYTHONDONTWRITEBYTECODE):
        # remove it so the artifact stays exactly what its manifest lists (precast.runtime.load checks).
        shutil.rmtree(Path(__file__).resolve().parent / "__pycache__", ignore_errors=True)
        _verify(artifact)
        if self.mode == "llm":
            from precast.runtime.llm import Engine

            num_blocks = int(params.get("precast_num_blocks") or 0) or None
            self.engine = Engine.load(artifact, num_blocks=num_blocks, threads=threads, verify=False)
            self.engine.start()
        else:
            from precast.runtime import load

            self.model = load(artifact, threads=threads, verify=False)
            self.input_names = [s.name for s in self.model.inputs]
            self.output_names = [s.name for s in self.model.outputs]

    # -- tensor models: requests of one dynamic batch run as one call when their shapes allow ------
    def execute(self, requests):
        if self.mode == "llm":
            for request in requests:
                self._submit(request)
            return None
        responses = [None] * len(requests)
        groups = {}  # (per-input dtype and shape past the batch dim) -> [(request index, feeds)]
        for i, request in enumerate(requests):
            feeds = {}
            for name in self.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is None:
                    responses[i] = _error(f"missing input '{name}'")
                    break
                feeds[name] = tensor.as_numpy()
            if responses[i] is None:
                batched = self.max_batch_size > 0 and all(a.ndim >= 1 for a in feeds.values())
                key = (
                    tuple((n, a.dtype.str, a.shape[1:]) for n, a in feeds.items())
                    if batched
                    else ("single", i)
                )
                groups.setdefault(key, []).append((i, feeds))
        for members in groups.values():
            self._run_group(members, responses)
        return responses

    def _run_group(self, members, responses):
        from precast.runtime.errors import PrecastError

        if len(members) > 1:
            sizes = [next(iter(f.values())).shape[0] for _, f in members]
            feeds = {n: np.concatenate([f[n] for _, f in members]) for n in self.input_names}
            try:
                outputs = self.model.run(feeds)
            except PrecastError:
                outputs = None  # one bad request: run them one by one so only it gets the error
            if outputs is not None:
                starts = np.cumsum([0] + sizes)
                for (i, _), a, b in zip(members, starts[:-1], starts[1:]):
                    responses[i] = self._response({n: v[a:b] for n, v in outputs.items()})
                return
        for i, feeds in members:
            try:
                responses[i] = self._response(self.model.run(feeds))
            except PrecastError as e:
                responses[i] = _error(str(e))

    def _response(self, outputs):
        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.output_names]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # -- LLMs (decoupled): one response per generated token, the last one flagged final ------------
    def _submit(self, request):
        from precast.runtime.errors import PrecastError
        from precast.runtime.llm import SamplingParams

        sender = request.get_response_sender()
        try:
            text = _scalar(request, "text_input", None)
            if text is None:
                raise ValueError("missing input 'text_input'")
            if isinstance(text, bytes):
                text = text.decode("utf-8")
            params = SamplingParams(
                max_tokens=int(_scalar(request, "max_tokens", 16)),
                temperature=float(_scalar(request, "temperature", 0.0)),
                top_k=int(_scalar(request, "top_k", 0)),
                top_p=float(_scalar(request, "top_p", 1.0)),
                seed=None if _scalar(request, "seed", None) is None else int(_scalar(request, "seed", None)),
            )
            self.engine.submit(text, params, on_token=lambda ev: self._send_token(sender, ev))
        except (PrecastError, ValueError, UnicodeDecodeError) as e:
            sender.send(_error(str(e)), flags=_FINAL)

    @staticmethod
    def _send_token(sender, ev):
        # Runs on the engine's step thread: never let a send failure stop the engine.
        try:
            out = [
                pb_utils.Tensor("text_output", np.array([ev.text.encode("utf-8")], dtype=np.object_)),
                pb_utils.Tensor("token_id", np.array([ev.token_id], dtype=np.int64)),
            ]
            if ev.finish_reason:
                out.append(
                    pb_utils.Tensor("finish_reason", np.array([ev.finish_reason.encode()], dtype=np.object_))
                )
            sender.send(
                pb_utils.InferenceResponse(output_tensors=out), flags=_FINAL if ev.finish_reason else 0
            )
        except Exception as e:  # noqa: BLE001 - logged; the engine keeps serving the other requests
            pb_utils.Logger.log_error(f"precast: could not send a token: {e}")

    def finalize(self):
        if self.mode == "llm":
            self.engine.stop()


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"input '{name}' must hold one value, got {values.size}")
    return values[0].item() if hasattr(values[0], "item") else values[0]
