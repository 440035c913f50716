"""The outlines-core ``Vocabulary`` of a transformers tokenizer, built offline.

outlines-core matches a regular expression byte by byte, so every token the grammar may
emit needs the exact bytes it decodes to:

* byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3): each character of a token stands for one
  byte through GPT-2's ``bytes_to_unicode`` table (``Ġ`` is a space, ``Ċ`` a newline);
* SentencePiece (Llama 2, Gemma): ``▁`` is a space and ``<0xNN>`` byte-fallback tokens are
  the single byte ``NN``; every other piece is its own UTF-8 text.

Special and control tokens (BOS, pad, ``<|im_start|>``, unused slots) never enter the
vocabulary, so no grammar allows them; EOS (the tokenizer's ``eos_token_id``) is the
grammar's end token, which outlines-core allows in final states only. Tokens that decode to
nothing are left out too (they would let a model loop without making progress), as are ids
at or beyond the model's logits width.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
PLAIN = "plain"  # unknown decoder: the token's text as UTF-8

SPIECE_SPACE = "\u2581"  # ▁
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table of byte-level BPE.

    Bytes that are printable and not whitespace stand for themselves; the other 68 map in
    order onto the characters from U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
# str.translate table: byte-level character -> the latin-1 character of its byte.
_TO_LATIN1 = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}
_NOT_BYTE_LEVEL = re.compile("[^" + "".join(re.escape(c) for c in sorted(_BYTE_OF_CHAR)) + "]")


def byte_level_token_bytes(token: str) -> bytes:
    """The bytes of a byte-level BPE token; like the ByteLevel decoder, a token with a character
    outside the byte alphabet (an added token's raw text) is its own UTF-8."""
    if _NOT_BYTE_LEVEL.search(token):
        return token.encode("utf-8")
    return token.translate(_TO_LATIN1).encode("latin-1")


def sentencepiece_token_bytes(token: str, byte_fallback: bool = True) -> bytes:
    """The bytes of a SentencePiece piece: ``<0xNN>`` is byte NN, ``▁`` a space."""
    if byte_fallback and len(token) == 6:
        match = _BYTE_FALLBACK.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")


@dataclass(frozen=True, slots=True)
class TokenizerVocabulary:
    """A tokenizer's vocabulary as outlines-core sees it, plus what the grammars need."""

    vocabulary: object  # outlines_core.Vocabulary
    eos_token_id: int | None  # the tokenizer's EOS (None: the grammar can only end by running out of tokens)
    end_token_id: int  # the id outlines-core treats as EOS (eos_token_id, or an id past every row when None)
    token_bytes: tuple[bytes | None, ...]  # by id: what a normal token decodes to; None for excluded ids
    kind: str  # BYTE_LEVEL, SENTENCEPIECE or PLAIN
    num_tokens: int  # normal tokens in the vocabulary (EOS not counted)
    build_seconds: float

    def decode(self, token_ids: list[int]) -> bytes:
        """The bytes of ``token_ids`` (EOS and excluded ids add nothing)."""
        table = self.token_bytes
        return b"".join(table[t] or b"" for t in token_ids if 0 <= t < len(table))


def _decoder_types(tokenizer) -> tuple[set[str], dict]:
    """The decoder component types of a fast tokenizer (``Sequence`` flattened), and its JSON."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return set(), {}
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # an exotic decoder without a JSON state
        return {type(decoder).__name__}, {}
    types: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if "type" in node:
                types.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(state)
    return types, state


def detect_kind(tokenizer, vocab: dict[str, int]) -> tuple[str, bool]:
    """(kind, byte_fallback) of ``tokenizer``: from its decoder where it has one (fast
    tokenizers), else from what its vocabulary looks like."""
    types, _ = _decoder_types(tokenizer)
    if "ByteLevel" in types:
        return BYTE_LEVEL, False
    if types & {"ByteFallback", "Metaspace"} or ("Replace" in types and _has_spiece_replace(tokenizer)):
        return SENTENCEPIECE, "ByteFallback" in types
    # Slow tokenizers, or a decoder that says nothing: look at the pieces.
    sample = list(vocab)[:: max(1, len(vocab) // 5000)]
    spiece = sum(t.startswith(SPIECE_SPACE) for t in sample)
    gpt2 = sum(t.startswith("\u0120") or t.endswith("\u010a") for t in sample)  # Ġ, Ċ
    if spiece > gpt2 and spiece > 0:
        return SENTENCEPIECE, any(f"<0x{b:02X}>" in vocab for b in (0x0A, 0x20, 0xE2))
    if gpt2 > 0:
        return BYTE_LEVEL, False
    logger.warning(
        "outlines: could not tell how %s decodes tokens (decoder types: %s); using each token's text as UTF-8",
        type(tokenizer).__name__, ", ".join(sorted(types)) or "none",
    )
    return PLAIN, False


def _has_spiece_replace(tokenizer) -> bool:
    _, state = _decoder_types(tokenizer)
    return SPIECE_SPACE in json.dumps(state, ensure_ascii=False)


def special_token_ids(tokenizer) -> set[int]:
    """Ids the grammar never allows: the tokenizer's special tokens and added tokens marked special."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in added.items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids


def _full_vocab(tokenizer) -> dict[str, int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=True)
    return tokenizer.get_vocab()


def build_vocabulary(tokenizer, vocab_size: int | None = None) -> TokenizerVocabulary:
    """Build the outlines-core vocabulary of ``tokenizer`` (see the module docstring).

    ``vocab_size`` is the model's logits width; ids at or above it are left out.
    """
    from outlines_core import Vocabulary

    start = time.perf_counter()
    vocab = _full_vocab(tokenizer)
    if not vocab:
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has an empty vocabulary")
    kind, byte_fallback = detect_kind(tokenizer, vocab)
    special = special_token_ids(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = int(eos) if eos is not None else None
    added = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}

    size = max(vocab.values()) + 1
    limit = size if vocab_size is None else min(size, vocab_size)
    excluded = special | ({eos} if eos is not None else set())
    items = [(t, i) for t, i in vocab.items() if i < limit and i not in excluded]
    # One pass per kind, without a function call per token (262k tokens for Gemma).
    if kind == BYTE_LEVEL:
        not_byte_level, to_latin1 = _NOT_BYTE_LEVEL.search, _TO_LATIN1
        pairs = [
            (t.encode("utf-8") if not_byte_level(t) else t.translate(to_latin1).encode("latin-1"), i)
            for t, i in items
        ]
    elif kind == SENTENCEPIECE:
        fallback = _BYTE_FALLBACK.fullmatch if byte_fallback else None
        pairs = []
        append = pairs.append
        for t, i in items:
            if fallback is not None and len(t) == 6 and t[0] == "<" and i not in added and (m := fallback(t)):
                append((bytes((int(m.group(1), 16),)), i))
            else:
                append((t.replace(SPIECE_SPACE, " ").encode("utf-8"), i))
    else:
        pairs = [(t.encode("utf-8"), i) for t, i in items]

    table: list[bytes | None] = [None] * size
    by_bytes: dict[bytes, list[int]] = {}
    for data, token_id in pairs:
        if not data:
            continue
        table[token_id] = data
        ids = by_bytes.get(data)
        if ids is None:
            by_bytes[data] = [token_id]
        else:
            ids.append(token_id)
    if not by_bytes:
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no normal tokens a grammar could use")

    # outlines-core needs an EOS id. Without one, use an id past every bitmask row: the
    # grammar then never offers it and ends only where nothing but EOS could follow.
    end_token_id = eos if eos is not None else max(size, vocab_size or 0) + 32
    vocabulary = Vocabulary(end_token_id, by_bytes)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(v) for v in by_bytes.values())
    logger.info(
        "outlines: built the %s vocabulary of %s (%d tokens, EOS %s) in %.2f s",
        kind, type(tokenizer).__name__, num_tokens, eos, seconds,
    )
    return TokenizerVocabulary(vocabulary, eos, end_token_id, tuple(table), kind, num_tokens, seconds)


# ---------------------------------------------------------------------------- cache
# The engine hands each backend its own deep copy of the tokenizer, so the cache is keyed by
# the tokenizer object (cheap) and then by what the vocabulary is built from.
_lock = threading.Lock()
_by_object: "weakref.WeakKeyDictionary[object, dict[int | None, TokenizerVocabulary]]" = weakref.WeakKeyDictionary()
_by_content: dict[tuple, TokenizerVocabulary] = {}
_MAX_CONTENT_ENTRIES = 4


def _content_key(tokenizer, vocab_size: int | None) -> tuple:
    """What tells two tokenizers' vocabularies apart, cheaply: size, special and added tokens,
    EOS, and a sample of the pieces (a deep copy of a tokenizer has the same key)."""
    vocab_len = len(tokenizer)
    sample = tuple(tokenizer.convert_ids_to_tokens(list(range(0, vocab_len, 61))))
    added = tuple(sorted(
        (int(i), t.content, bool(t.special)) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
    ))
    return (
        type(tokenizer).__name__,
        getattr(tokenizer, "name_or_path", None),
        vocab_len,
        hash(sample),
        hash(added),
        tuple(sorted(special_token_ids(tokenizer))),
        getattr(tokenizer, "eos_token_id", None),
        vocab_size,
    )


def get_vocabulary(tokenizer, vocab_size: int | None = None) -> TokenizerVocabulary:
    """:func:`build_vocabulary`, cached per tokenizer (and per equal copy of one)."""
    with _lock:
        try:
            per_object = _by_object.get(tokenizer)
        except TypeError:  # not weak-referenceable
            per_object = None
        if per_object is not None and vocab_size in per_object:
            return per_object[vocab_size]
        key = _content_key(tokenizer, vocab_size)
        result = _by_content.get(key)
        if result is None:
            result = build_vocabulary(tokenizer, vocab_size)
            _by_content[key] = result
            while len(_by_content) > _MAX_CONTENT_ENTRIES:
                _by_content.pop(next(iter(_by_content)))
        try:
            _by_object.setdefault(tokenizer, {})[vocab_size] = result
        except TypeError:
            pass
        return result
