"""Incremental detokenization of generated tokens, with stop strings.

Each step appends a few token ids; the text grows by decoding only a short
window of recent ids, never the whole output again. Two offsets into the ids
(``prefix`` and ``read``, as in Hugging Face's TextStreamer and vLLM) mark the
window: the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is
what the new ids add. Decoding a window that starts one token early keeps the
context a decoder needs (SentencePiece leading spaces), and text is held back
while it ends in an incomplete character, so "\\ufffd" is never emitted for a
multi-byte character split across tokens.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from runtime.sampling_params import SamplingParams

# Prompt tokens decoded together with the first output tokens, so that the
# first output token gets the leading space it would have inside the text.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(
    text: str, num_new_chars: int, search_floor: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find the stop string completed first (the one that ends earliest; of those, the one that
    starts earliest) among those that end inside the last ``num_new_chars`` of ``text``: the
    text stops where the first stop string is complete, even when one token brings several.

    Matches starting before ``search_floor`` are ignored. Returns the stop
    string and the length ``text`` is truncated to (before the stop string,
    or after it when ``include_stop_str_in_output``), or None.
    """
    best: tuple[int, int, str] | None = None
    for stop_str in stop:
        start = max(search_floor, len(text) - num_new_chars - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or (index + len(stop_str), index) < best[:2]):
            best = (index + len(stop_str), index, stop_str)
    if best is None:
        return None
    end, index, stop_str = best
    return stop_str, end if include_stop_str_in_output else index


class BaseDetokenizer:
    """Keeps the output token ids and text of one request; checks stop strings.

    Subclasses say how one new token id turns into text (``_decode_next``) and
    how held-back text is released at the end (``_flush_pending``).
    """

    def __init__(self, params: SamplingParams):
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # While streaming, this many trailing chars may be the start of a stop string.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._stop_search_floor = 0  # text produced within min_tokens never counts as a stop
        self._num_sent_chars = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append ``new_token_ids`` and their text; return the stop string that hit, if any.

        ``stop_terminated`` means the last id is the EOS or stop token that
        ended the request: it is kept in the ids but not in the text (unless
        ``include_stop_str_in_output``). On a stop string hit the text is
        truncated and the ids after the token that completed it are dropped.
        """
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if i == last and stop_terminated and not self.include_stop_str_in_output:
                new_text = ""
            else:
                new_text = self._decode_next(token_id)
            stop_str = self._append_text(new_text)
            if stop_str is not None:
                return stop_str
        return None

    def flush(self) -> str | None:
        """Release text held back at the end (an incomplete character); call once when finished.

        Returns the stop string that the released text completed, if any.
        """
        return self._append_text(self._flush_pending())

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (``delta``) only what was not sent before.

        While not finished, the last ``stop_buffer_length`` chars are held back:
        they may be the start of a stop string that the next tokens complete.
        """
        end = len(self.output_text)
        if not finished:
            end = max(end - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self._num_sent_chars
        if end <= start:
            return ""
        self._num_sent_chars = end
        return self.output_text[start:end]

    def _append_text(self, new_text: str) -> str | None:
        self.output_text += new_text
        if len(self.output_token_ids) <= self.min_tokens:
            self._stop_search_floor = len(self.output_text)
            return None
        if not new_text or not self.stop:
            return None
        hit = find_stop_string(
            self.output_text, len(new_text), self._stop_search_floor, self.stop, self.include_stop_str_in_output
        )
        if hit is None:
            return None
        stop_str, keep = hit
        self.output_text = self.output_text[:keep]
        return stop_str

    def _decode_next(self, token_id: int) -> str:
        raise NotImplementedError

    def _flush_pending(self) -> str:
        raise NotImplementedError


class NoopDetokenizer(BaseDetokenizer):
    """Keeps token ids only; the text stays "" (``detokenize=False`` or no tokenizer)."""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        # No text, so no stop string can hit: only the ids grow.
        self.output_token_ids.extend(new_token_ids)
        return None

    def _decode_next(self, token_id: int) -> str:
        return ""

    def _flush_pending(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class _TokenizerFacts:
    special_ids: frozenset[int]  # ids that skip_special_tokens removes
    # Of those, the ids that skip_special_tokens=True decodes to nothing: dropped before decoding,
    # they change no text around them, so they never enter the decode window.
    silent_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]  # ids of "<0xNN>" tokens (SentencePiece byte fallback)


_FACTS: "weakref.WeakKeyDictionary[object, _TokenizerFacts]" = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer) -> _TokenizerFacts:
    facts = _FACTS.get(tokenizer)
    if facts is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {i for i, tok in added.items() if getattr(tok, "special", False)}
        special.update(tokenizer.all_special_ids)
        byte_ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
        unk = tokenizer.unk_token_id
        facts = _TokenizerFacts(
            special_ids=frozenset(special),
            silent_ids=frozenset(i for i in special if tokenizer.decode([i], skip_special_tokens=True) == ""),
            byte_fallback_ids=frozenset(i for i in byte_ids if i is not None and i != unk),
        )
        try:
            _FACTS[tokenizer] = facts
        except TypeError:  # not weak-referenceable: recompute per request
            pass
    return facts


class IncrementalDetokenizer(BaseDetokenizer):
    """Turns output ids into text one token at a time with a Hugging Face tokenizer.

    At the end ``output_text`` equals ``tokenizer.decode(output_ids,
    skip_special_tokens=...)`` (less a stop-terminating token). With
    ``skip_special_tokens=False`` and ``spaces_between_special_tokens=True``,
    special tokens are decoded apart from the text around them and joined to
    it with a space, as Hugging Face's Python tokenizers do (then the prompt
    gives no context, so the text never starts with a joining space).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        super().__init__(params)
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        facts = _tokenizer_facts(tokenizer)
        self._special_ids = facts.special_ids
        self._byte_fallback_ids = facts.byte_fallback_ids
        self._skipped_ids = facts.special_ids if self.skip_special_tokens else frozenset()
        self._silent_ids = facts.silent_ids if self.skip_special_tokens else frozenset()
        self._split_special_tokens = not self.skip_special_tokens and params.spaces_between_special_tokens
        self._ids = self._initial_context(prompt_token_ids)  # context tokens, then output tokens
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._predecoded: tuple[int, str, str] | None = None  # (number of ids, prefix text, full text) of the next token

    @property
    def can_batch_decode(self) -> bool:
        """Whether ``decode_windows`` applies: one plain ``decode`` per window (not split at special tokens)."""
        return not self._split_special_tokens

    def decode_windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """The two id windows ``_decode_next(token_id)`` decodes; ``set_predecoded`` hands in their texts."""
        return self._ids[self._prefix_offset : self._read_offset], self._ids[self._prefix_offset :] + [token_id]

    def set_predecoded(self, prefix_text: str, full_text: str) -> None:
        """The texts of ``decode_windows``' windows, decoded with others of the same step in one batch."""
        self._predecoded = (len(self._ids) + 1, prefix_text, full_text)

    def _initial_context(self, prompt_token_ids: list[int]) -> list[int]:
        if self._split_special_tokens:
            return []  # the text starts with the output's first piece, never a joining space
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        # A prompt ending inside a character gives no clean boundary: start afresh.
        if self._ends_in_byte_run(context) or self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode_next(self, token_id: int) -> str:
        predecoded, self._predecoded = self._predecoded, None
        if token_id in self._silent_ids:
            # Kept out of the window: a run of them (ignore_eos) would otherwise widen it with each
            # token, and every step would decode the whole run again (quadratic time).
            return ""
        self._ids.append(token_id)
        if predecoded is not None and predecoded[0] == len(self._ids):
            _, prefix_text, full_text = predecoded
        else:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset :])
        if (
            len(full_text) <= len(prefix_text)
            or full_text.endswith(_REPLACEMENT_CHAR)
            or self._ends_in_byte_run(self._ids, self._prefix_offset)
        ):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _flush_pending(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _ends_in_byte_run(self, ids: list[int], start: int = 0) -> bool:
        """Whether the last kept token of ``ids[start:]`` is a byte-fallback token.

        The byte-fallback decoder turns a whole run of byte tokens into "\\ufffd"s
        when any part of it is invalid, so text is held until the run ends.
        """
        if not self._byte_fallback_ids:
            return False
        for i in range(len(ids) - 1, start - 1, -1):
            if ids[i] not in self._skipped_ids:
                return ids[i] in self._byte_fallback_ids
        return False

    def _decode(self, ids: list[int]) -> str:
        if not self._split_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._special_ids:
                if run:
                    pieces.append(self.tokenizer.decode(run))
                    run = []
                pieces.append(self.tokenizer.decode([token_id]))
            else:
                run.append(token_id)
        if run:
            pieces.append(self.tokenizer.decode(run))
        return " ".join(pieces)


def batch_decoder(tokenizer):
    """``decode(list of id lists, skip_special_tokens) -> texts`` in one call into a fast tokenizer's Rust
    ``decode_batch`` where that gives what ``tokenizer.decode`` does (no Python-side clean-up); else one
    ``tokenizer.decode`` per list."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if hasattr(backend, "decode_batch") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda seqs, skip: backend.decode_batch(seqs, skip_special_tokens=skip)
    return lambda seqs, skip: [tokenizer.decode(ids, skip_special_tokens=skip) for ids in seqs]


def make_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> BaseDetokenizer:
    """An IncrementalDetokenizer, or a NoopDetokenizer without a tokenizer or with ``detokenize=False``."""
    if tokenizer is not None and params.detokenize:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
    if params.stop:
        why = "skip_tokenizer_init=True (no tokenizer)" if tokenizer is None else "detokenize=False"
        raise ValueError(f"stop strings {params.stop!r} need detokenized text, but the request has {why}")
    return NoopDetokenizer(params)


def decode_token(tokenizer, token_id: int) -> str:
    """The text of one token id, for ``Logprob.decoded_token`` (special tokens kept)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
