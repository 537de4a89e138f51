"""What passes, targets and the compiler share about an onnx-ir model, below all three of them.

``registry`` (the pass base: Pass, PassContext, PassResult/PassFacts, the plugin tables), ``pipeline``
(pipeline strings and the PassManager), ``parity`` (running a graph on ONNX Runtime and comparing),
``calibration`` (calibration feeds), ``stages`` / ``stage_cuts`` (cutting an annotated model into stage
models), ``llm_text`` (a step graph scored on text).
Imports the artifact contract and the runtime, never passes, targets or the compiler.
"""
