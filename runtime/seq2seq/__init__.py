"""Encoder-decoder (seq2seq) generation: Hugging Face-exact decoding logic (greedy, beam search) in numpy."""
