"""Frontends: a source (ONNX file, torch module, Hugging Face folder) -> an onnx-ir model and its reference."""
