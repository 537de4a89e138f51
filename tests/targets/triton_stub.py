"""A stand-in for Triton's ``triton_python_backend_utils`` with the calls precast's model.py files make, and
a loader that initializes a repository's Python model the way the stub does (its config as JSON)."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import numpy as np

from tests.targets.pbtxt import one, parse

__all__ = ["Request", "Response", "load_python_model", "stub_module"]


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class Sender:
    def __init__(self):
        self.sent: list[tuple[Response, int]] = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class Request:
    def __init__(self, **inputs):
        self.inputs = {k: Tensor(k, v) for k, v in inputs.items()}
        self.sender = Sender()

    def get_response_sender(self):
        return self.sender


def stub_module() -> types.ModuleType:
    """The module to install as ``sys.modules["triton_python_backend_utils"]``."""
    mod = types.ModuleType("triton_python_backend_utils")
    mod.Tensor = Tensor
    mod.InferenceResponse = Response
    mod.TritonError = lambda msg: msg
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    mod.get_input_tensor_by_name = lambda req, name: req.inputs.get(name)
    mod.Logger = types.SimpleNamespace(log_error=lambda msg: None)
    return mod


def load_python_model(art: Path, name: str):
    """Import ``model_repository/<name>/1/model.py`` and initialize its TritonPythonModel."""
    model_dir = art / "model_repository" / name
    spec = importlib.util.spec_from_file_location(f"triton_model_{name}", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = parse((model_dir / "config.pbtxt").read_text())
    params = {
        one(p, "key"): {"string_value": one(one(p, "value"), "string_value")} for p in cfg["parameters"]
    }
    config = {"max_batch_size": one(cfg, "max_batch_size"), "parameters": params}
    instance = module.TritonPythonModel()
    instance.initialize(
        {"model_config": json.dumps(config), "model_repository": str(model_dir), "model_version": "1"}
    )
    return instance
