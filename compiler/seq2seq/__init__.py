"""Encoder-decoder models (text2text, Whisper speech recognition): export, compile, verification."""
