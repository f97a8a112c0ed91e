"""A token's own bytes and text, as OpenAI's log-probabilities report them.

A byte-level BPE token (GPT-2's, every GGUF model Ember imports) is a string of stand-in
characters, one per byte (GPT-2's ``bytes_to_unicode`` table); its bytes are those the
table maps back to. A token may hold part of a UTF-8 character: its ``bytes`` are exact, its
text has U+FFFD for the partial character (OpenAI's ``bytes`` field exists for that case).
Other tokenizers fall back to decoding the token alone.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: stand-in character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Bytes and text of single tokens of ``tokenizer`` (a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import decoders

        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._decoder = _byte_decoder() if self._byte_level else {}
        self.bytes_of = lru_cache(maxsize=1 << 16)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._decoder for c in piece):
            return bytes(self._decoder[c] for c in piece)
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text.encode("utf-8")

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")
