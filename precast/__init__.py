"""precast: an ahead-of-time model compiler with a thin runtime.

The compiler lives in ``precast.compiler`` / ``precast.targets`` / ``precast.passes`` / ``precast.ir``; the
runtime (numpy + the backend of the artifact it runs: onnxruntime, openvino or tensorrt) in
``precast.runtime``; the artifact contract between them in ``precast.artifact`` (docs/architecture.md,
"Layout").
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
