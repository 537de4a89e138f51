"""Decoder export: a Hugging Face causal LM's own forward -> the engine's step graph (paged, mapped, OpenVINO)."""
