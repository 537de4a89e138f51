"""ONNX Runtime sessions as precast opens them: ORT's own InferenceSession, plus the handles its fast paths use.

The LLM runners bind the KV pool's views with IO binding and run a step a few hundred microseconds long;
ORT's Python ``run_with_iobinding`` spends ~6 us a call on checks (WebGPU graph capture) a CPU session never
needs, as long as a whole small-model decode step's Python. So the runners call the C++ session directly:

    session = OrtSession(path, sess_options=..., providers=...)   # an InferenceSession (everything takes it)
    io = session.io_binding()                                     # an OrtBinding (an IOBinding)
    session.native.run_with_iobinding(io.native, None)            # ORT's C++ objects: no Python checks

``native`` is ORT's pybind object under each (the ``_sess`` / ``_iobinding`` attributes ORT's own Python
wrappers keep, read here, by the subclasses, and nowhere else). onnxruntime is imported by this module:
import it lazily (backends.create_ort_session does).
"""

from __future__ import annotations

from typing import Protocol

import onnxruntime as ort

__all__ = ["NativeOrtSession", "OrtBinding", "OrtSession", "native_session"]


class NativeOrtSession(Protocol):
    """ORT's C++ session (``onnxruntime.capi._pybind_state.InferenceSession``): what the fast paths call."""

    def run_with_iobinding(self, binding: object, run_options: object | None) -> None: ...


class OrtBinding(ort.IOBinding):
    """ORT's IOBinding; ``native`` is its C++ binding, which ``NativeOrtSession.run_with_iobinding`` takes.
    (A CPU binding is its names and bound buffers: any session of the same graph runs it, see spin_switch.)"""

    @property
    def native(self) -> object:
        return self._iobinding


class OrtSession(ort.InferenceSession):
    """ORT's InferenceSession; ``native`` is its C++ session, ``io_binding()`` makes OrtBindings."""

    @property
    def native(self) -> NativeOrtSession:
        return self._sess

    def io_binding(self) -> OrtBinding:
        return OrtBinding(self)


def native_session(session: object) -> NativeOrtSession | None:
    """The C++ session to run ``session``'s bindings on: an OrtSession's own; None for anything else (a
    session some caller wraps to time or count its runs, a stand-in), whose ``run_with_iobinding`` is then
    called as it is."""
    return session.native if isinstance(session, OrtSession) else None
