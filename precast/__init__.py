"""precast: an ahead-of-time model compiler with a thin runtime.

The compiler lives in ``precast.compiler`` / ``precast.passes`` / ``precast.targets``; the runtime
(numpy + the backend of the artifact it runs: onnxruntime, openvino or tensorrt) in ``precast.runtime``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
