"""Compile targets: one module per target, registered by name (``ort_cpu.py`` <-> ``ort-cpu``).

The registry's names load on first use, so a child process that runs one vendor step
(``python -m precast.targets.isolated``) does not import onnx-ir and every target first.
"""

__all__ = ["Target", "all_targets", "get_target"]


def __getattr__(name: str):
    if name in __all__:
        from precast.targets import base

        return getattr(base, name)
    raise AttributeError(f"module 'precast.targets' has no attribute {name!r}")
