"""Moved to ``precast.errors``; kept so that code written against ``precast.runtime.errors`` still runs.

A Triton model repository compiled before the move ships a ``model.py`` that imports its errors from here
(tests/data/triton_v1/), and it runs against whatever precast the serving host has installed.
"""

from precast.errors import *  # noqa: F403
from precast.errors import __all__  # noqa: F401


def __getattr__(name: str):
    """The names outside ``__all__`` too (the exit codes, helpers), as the module had them."""
    import precast.errors as moved

    return getattr(moved, name)
