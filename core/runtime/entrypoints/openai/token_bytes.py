"""A token's own bytes, for OpenAI's logprob ``bytes`` field.

OpenAI gives each token's UTF-8 bytes so that a client can join the tokens that split one
character. The decoded text of such a token is U+FFFD, whose bytes say nothing; the token's
own bytes come from the tokenizer's vocabulary instead: byte-level BPE (GPT-2's alphabet of
256 printable stand-ins, as in SmolLM2, Llama 3, Qwen) and SentencePiece with byte fallback
(``<0xNN>`` pieces, ``▁`` for a space, as in Gemma and Llama 2). Other tokenizers, and special
tokens, give the bytes of the token's text.
"""

from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's stand-in character -> byte: printable Latin-1 bytes stand for
    themselves, the other bytes (controls, space, a few others) for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    parts = state.get("decoders", [state]) if isinstance(state, dict) else []
    return {part.get("type") for part in parts if isinstance(part, dict)}


class TokenBytes:
    """``token_bytes(token_id, text)``: the token's own bytes, or ``text``'s where the vocabulary does not say."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.alphabet = _byte_level_alphabet() if "ByteLevel" in types else None
        self.byte_fallback = "ByteFallback" in types
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        raw = self.cache.get(token_id)
        if raw is None:
            raw = self._lookup(token_id)
            if len(self.cache) < 1 << 18:
                self.cache[token_id] = raw
        return list(raw if raw is not None and (raw or not text) else text.encode())

    def _lookup(self, token_id: int) -> bytes | None:
        if token_id in self.special or (self.alphabet is None and not self.byte_fallback):
            return None
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except (IndexError, KeyError, TypeError, ValueError, OverflowError):
            return None
        if not isinstance(piece, str):
            return None
        if self.alphabet is not None:
            try:
                return bytes(self.alphabet[c] for c in piece)
            except KeyError:  # an added token outside the alphabet: its text
                return None
        match = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace(_SPACE_MARK, " ").encode()
