"""KServe v2 / Triton inference protocol (JSON): request -> feeds, outputs -> response, model metadata."""

from __future__ import annotations

import math

import numpy as np

from precast.errors import InputError

__all__ = ["DATATYPES", "decode_request", "encode_response", "model_metadata", "requested_outputs"]

DATATYPES = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
_BY_NUMPY = {v: k for k, v in DATATYPES.items()}


def _v2_type(dtype: str) -> str:
    return _BY_NUMPY.get(dtype, "BYTES" if dtype in ("str", "object") else dtype.upper())


def _v2_shape(shape) -> list[int]:
    return [-1] if shape is None else [d if isinstance(d, int) else -1 for d in shape]


def decode_request(body: object) -> dict[str, np.ndarray]:
    """The "inputs" of a v2 infer request as numpy arrays; InputError names the bad tensor."""
    if not isinstance(body, dict):
        raise InputError("request body must be a JSON object with an 'inputs' list")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InputError("request needs a non-empty 'inputs' list")
    feeds: dict[str, np.ndarray] = {}
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InputError(f"inputs[{i}] must be an object with a 'name'")
        name = t["name"]
        if name in feeds:
            raise InputError(f"input '{name}' is given twice")
        datatype = t.get("datatype")
        if datatype not in DATATYPES:
            raise InputError(
                f"input '{name}': unsupported datatype {datatype!r} (one of {', '.join(DATATYPES)})"
            )
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InputError(
                f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}"
            )
        if "data" not in t:
            raise InputError(f"input '{name}' has no 'data' (binary tensors are not supported)")
        try:
            arr = np.asarray(t["data"], dtype=DATATYPES[datatype])
        except (TypeError, ValueError, OverflowError) as e:
            raise InputError(f"input '{name}': data is not {datatype} ({e})") from e
        if arr.size != math.prod(shape):
            raise InputError(f"input '{name}': shape {shape} needs {math.prod(shape)} values, got {arr.size}")
        feeds[name] = arr.reshape(shape)
    return feeds


def requested_outputs(body: dict, known: list[str]) -> list[str] | None:
    outs = body.get("outputs")
    if outs is None:
        return None
    if not isinstance(outs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outs
    ):
        raise InputError("'outputs' must be a list of objects with a 'name'")
    names = [o["name"] for o in outs]
    for n in names:
        if n not in known:
            raise InputError(f"unknown output '{n}'; the model's outputs are: {', '.join(known)}")
    return names


def encode_response(
    model_name: str, version: str, outputs: dict[str, np.ndarray], request_id: str | None
) -> dict:
    body = {
        "model_name": model_name,
        "model_version": version,
        "outputs": [
            {
                "name": n,
                "datatype": _v2_type(a.dtype.name),
                "shape": list(a.shape),
                "data": a.ravel().tolist(),
            }
            for n, a in outputs.items()
        ],
    }
    if request_id is not None:
        body["id"] = request_id
    return body


def model_metadata(model_name: str, version: str, model) -> dict:
    return {
        "name": model_name,
        "versions": [version],
        "platform": f"precast_{model.target}",
        "inputs": [
            {"name": s.name, "datatype": _v2_type(s.dtype), "shape": _v2_shape(s.shape)} for s in model.inputs
        ],
        "outputs": [
            {"name": s.name, "datatype": _v2_type(s.dtype), "shape": _v2_shape(s.shape)}
            for s in model.outputs
        ],
    }
