"""Child-process entries that die the way vendor libraries do (run by precast.targets.isolated in tests)."""

import ctypes
import sys
import time


def segfault(payload):
    ctypes.string_at(0)  # a real SIGSEGV: reads address 0


def segfault_after_qnn_log(payload):
    # What QNN's EP prints just before its HTP compiler segfaults on a graph it cannot take
    sys.stderr.write(
        "[E:onnxruntime:, qnn_execution_provider.cc:2453 GetCapabilityImpl] Unsupported nodes in QNN EP: "
        "{ name: node_Shape_4, type: Shape }{ name: node_GatherND_75, type: GatherND }\n"
    )
    sys.stderr.flush()
    ctypes.string_at(0)


def hang(payload):
    time.sleep(120)


def refuse(payload):
    from precast.errors import UsageError

    raise UsageError("entry refused: bad payload")


def bug(payload):
    return {}["missing"]


def echo(payload):
    print("native code printing to stdout")  # must not corrupt the result
    return {"echo": payload}
