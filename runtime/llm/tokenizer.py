"""The artifact's tokenizer (Hugging Face `tokenizers` file), behind a two-method interface."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from precast.errors import ArtifactError, first_line

__all__ = ["MAX_DECODER_STEPS", "MAX_PIECE_CHARS", "TextTokenizer", "check_decode_bounded"]

# Decoding runs in the engine's step loop for every generated token (the server's incremental text). Its cost
# must be bounded by the artifact's shape, not chosen by it: fixed-string decoders only, few of them, and
# pieces of bounded length (a 100 MB piece would make each token's text 100 MB).
MAX_PIECE_CHARS = 1024
MAX_DECODER_STEPS = 32
MAX_REPLACE_CHARS = 16  # a decoder's Replace content (real ones: "▁" -> " ")
MAX_DECODE_GROWTH = 4  # the most the decoder chain's replacements may multiply a text by
_DECODERS = {
    "ByteLevel",
    "ByteFallback",
    "Fuse",
    "Strip",
    "Metaspace",
    "WordPiece",
    "BPEDecoder",
    "CTC",
    "Replace",
}


class TextTokenizer:
    """encode(text) -> ids, decode(ids) -> text. The engine needs nothing else from a tokenizer."""

    def __init__(self, tok):
        self._tok = tok

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TextTokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers is a runtime dependency of LLM artifacts
            raise ArtifactError("LLM artifacts need the 'tokenizers' package: pip install tokenizers") from e
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ArtifactError(f"cannot read tokenizer {path}: {first_line(e)}") from e
        check_decode_bounded(path)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # A batch of one, not encode: the same ids, but it releases the GIL while it works (encode holds it:
        # a long prompt would freeze the engine loop and the event loop for seconds). The _fast variant
        # (tokenizers >= 0.20) skips the character offsets, which nothing here reads.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return list(batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (two tokenizers with equal vocabularies map text to
        the same ids when their pre-tokenizers and merges agree: speculative decoding compares these)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine reads its vocabulary from)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, when its piece spells them (byte-level BPE, or a SentencePiece
        byte-fallback piece like <0xE2>); None otherwise. Alone, such a token may be part of a character."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        table = _byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None


_BYTE_LEVEL: dict[str, int] | None = None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> that byte."""
    global _BYTE_LEVEL
    if _BYTE_LEVEL is None:
        keep = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), 256),
        ]
        chars, extra = {}, 0
        for b in range(256):
            if b in keep:
                chars[chr(b)] = b
            else:
                chars[chr(256 + extra)] = b
                extra += 1
        _BYTE_LEVEL = chars
    return _BYTE_LEVEL


def check_decode_bounded(path: str | os.PathLike) -> None:
    """ArtifactError naming the field unless decoding with the tokenizer at ``path`` is linear in its pieces:
    the decoder chain uses only fixed-string decoders (no regex: a backtracking pattern would run on every
    generated token, inside the engine's step loop), at most MAX_DECODER_STEPS of them, whose replacements grow
    a text at most MAX_DECODE_GROWTH-fold (a chain of "e" -> 1000 x "e" was 10^12 characters), and every vocabulary
    piece and added token is at most MAX_PIECE_CHARS characters. Encoding (normalizer, pre-tokenizer regexes)
    is not checked here: the server runs it in a sandbox process with a deadline (runtime/server/text_sandbox.py)."""
    where = Path(path).name
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"cannot read tokenizer {path}: {first_line(e)}") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"tokenizer {where}: not a JSON object")
    _DecoderChain(where).walk(data.get("decoder"), "decoder")
    _check_pieces(data, where)


class _DecoderChain:
    """A walk through a decoder and its nested Sequences that counts the steps and how much their
    replacements can multiply a text, and stops at the first step over a bound."""

    def __init__(self, where: str):
        self.where = where
        self.steps = 0
        self.growth = 1.0

    def walk(self, dec, field: str) -> None:
        if dec is None:
            return
        if not isinstance(dec, dict):
            raise ArtifactError(f"tokenizer {self.where}: '{field}' must be an object")
        kind = dec.get("type")
        if kind == "Sequence":
            subs = dec.get("decoders")
            if not isinstance(subs, list):
                raise ArtifactError(f"tokenizer {self.where}: '{field}.decoders' must be a list")
            for i, sub in enumerate(subs):
                self.walk(sub, f"{field}.decoders[{i}]")
            return
        self.steps += 1
        if self.steps > MAX_DECODER_STEPS:
            raise ArtifactError(
                f"tokenizer {self.where}: '{field}': more than {MAX_DECODER_STEPS} decoder steps"
            )
        if kind not in _DECODERS:
            raise ArtifactError(
                f"tokenizer {self.where}: '{field}.type' {kind!r} is not a decoder precast runs"
            )
        if kind == "Replace":
            self.replace(dec, field)

    def replace(self, dec: dict, field: str) -> None:
        """A Replace step: a fixed string (no regex) by a short one; the chain's growth stays bounded."""
        where, pattern = self.where, dec.get("pattern")
        if not (isinstance(pattern, dict) and set(pattern) == {"String"}):
            raise ArtifactError(
                f"tokenizer {where}: '{field}.pattern' must be a fixed string (a regex would run on every "
                "generated token)"
            )
        old, new = pattern["String"], dec.get("content")
        if not isinstance(old, str) or not old or not isinstance(new, str) or len(new) > MAX_REPLACE_CHARS:
            raise ArtifactError(
                f"tokenizer {where}: '{field}' must replace a non-empty string by at most "
                f"{MAX_REPLACE_CHARS} characters"
            )
        self.growth *= max(1.0, len(new) / len(old))  # each step can multiply the text by this
        if self.growth > MAX_DECODE_GROWTH:
            raise ArtifactError(
                f"tokenizer {where}: '{field}': the decoder's replacements can grow a token's text "
                f"{self.growth:g}-fold (at most {MAX_DECODE_GROWTH})"
            )


def _check_pieces(data: dict, where: str) -> None:
    """Every vocabulary piece and added token at most MAX_PIECE_CHARS characters."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    pieces = (
        vocab.keys() if isinstance(vocab, dict) else (v[0] for v in vocab or () if isinstance(v, list) and v)
    )
    added = (t.get("content") for t in data.get("added_tokens") or () if isinstance(t, dict))
    for field, items in (("model.vocab", pieces), ("added_tokens", added)):
        for piece in items:
            if isinstance(piece, str) and len(piece) > MAX_PIECE_CHARS:
                raise ArtifactError(
                    f"tokenizer {where}: '{field}' has a piece of {len(piece)} characters (at most "
                    f"{MAX_PIECE_CHARS}: each generated token's text is decoded in the engine's step loop)"
                )
