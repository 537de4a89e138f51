"""Moved to ``precast.artifact.manifest``; kept so that code written against ``precast.runtime.manifest``
still runs.

A Triton model repository compiled before the move ships a ``model.py`` that reads its manifest through
this module (tests/data/triton_v1/), and it runs against whatever precast the serving host has installed.
"""

from precast.artifact.manifest import *  # noqa: F403
from precast.artifact.manifest import __all__  # noqa: F401


def __getattr__(name: str):
    """The names outside ``__all__`` too (the exit codes, helpers), as the module had them."""
    import precast.artifact.manifest as moved

    return getattr(moved, name)
