"""Compile targets: one module per target, registered by name (``ort_cpu.py`` <-> ``ort-cpu``)."""

from precast.targets.base import Target, all_targets, get_target

__all__ = ["Target", "all_targets", "get_target"]
