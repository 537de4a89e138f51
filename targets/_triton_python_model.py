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

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _verify(root: Path) -> None:
    """sha256 of every file the manifest lists. (precast.runtime.load(verify=True) also refuses unlisted
    files, and another instance's stub may be writing __pycache__ beside this file right now.)"""
    from precast.artifact.manifest import read_manifest, sha256_file
    from precast.errors import IntegrityError

    for rel, digest in sorted(read_manifest(root)["files"].items()):
        path = root / rel
        if not path.is_file() or sha256_file(path) != digest:
            raise IntegrityError(f"artifact {root}: file '{rel}' is missing or was modified")


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        from precast.runtime.triton_python import StubConfig, drop_pycache

        config = StubConfig.from_args(args)
        self.artifact = artifact = config.artifact
        threads = config.threads
        self.mode = config.params.get("precast_mode") or "tensor"
        self.max_batch_size = config.max_batch_size
        drop_pycache(__file__)  # (what the stub's import of this file wrote beside it)
        _verify(artifact)
        if self.mode == "llm":
            from precast.runtime.llm import Engine

            num_blocks = int(config.params.get("precast_num_blocks") or 0) or None
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
        from precast.runtime.triton_python import request_feeds, run_requests

        # (a request's error is its own response: a merged call that fails is rerun request by request)
        feeds = request_feeds(requests, self.input_names, pb_utils.get_input_tensor_by_name)
        results = run_requests(feeds, self.model.run, batched=self.max_batch_size > 0)
        return [self._response(r) for r in results]

    def _response(self, outputs):
        if isinstance(outputs, Exception):
            return _error(str(outputs))
        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.output_names]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # -- LLMs (decoupled): one response per generated token, the last one flagged final ------------
    def _submit(self, request):
        from precast.errors import PrecastError
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
