"""One compiled spec (an outlines-core ``Index`` and what its grammars share) and one request's
walk over it, the :class:`runtime.structured_output.Grammar` of the ``outlines`` backend."""

from __future__ import annotations

import torch

from runtime.structured_output import GuidedKind
from runtime_outlines.masks import ENDED_SLOT, MaskTable
from runtime_outlines.vocabulary import TokenizerVocabulary

# Guide states kept for cheap rollback; a longer rollback replays the accepted tokens.
MAX_ROLLBACK = 32


class CompiledSpec:
    """One compiled spec: the outlines-core index and what its grammars share."""

    def __init__(self, kind: GuidedKind, regex: str, index, vocab: TokenizerVocabulary, seconds: float, masks: MaskTable):
        self.kind = kind
        self.regex = regex
        self.index = index
        self.vocab = vocab
        self.eos_token_id = vocab.eos_token_id
        self.end_token_id = vocab.end_token_id
        self.compile_seconds = seconds
        self._only_end: dict[int, bool] = {}  # final state -> no token but EOS allowed
        # state -> its row in the backend's mask table (filled by outlines-core on first use)
        self.masks = masks
        self.slots: dict[int, int] = masks.register(self)

    def add_slot(self, guide, state: int) -> int:
        """The mask table slot of ``state`` (the guide's current one), written on first use."""
        slot = self.slots[state] = self.masks.add(guide)
        return slot

    def only_end_allowed(self, state: int) -> bool:
        """True when ``state`` is final and nothing but EOS may follow."""
        result = self._only_end.get(state)
        if result is None:
            if not self.index.is_final_state(state):
                result = False
            else:
                allowed = self.index.get_allowed_tokens(state) or []
                result = all(t == self.end_token_id for t in allowed)
            self._only_end[state] = result
        return result


class OutlinesGrammar:
    """One request's walk over a compiled spec (implements ``runtime.structured_output.Grammar``).

    The current state is kept beside outlines-core's ``Guide`` (which follows every accepted
    token, for its rollback and its bitmask rows), so the per-step calls read a Python int."""

    __slots__ = ("_compiled", "_guide", "_tokens", "_ended", "_state", "_slots")

    def __init__(self, compiled: CompiledSpec):
        from outlines_core import Guide

        self._compiled = compiled
        self._guide = Guide(compiled.index, max_rollback=MAX_ROLLBACK)
        self._state: int = self._guide.get_state()
        self._slots = compiled.slots  # state -> mask table slot, shared by the spec's grammars
        self._tokens: list[int] = []  # accepted tokens, EOS excluded
        self._ended = False  # EOS accepted

    # -------------------------------------------------------------- advancing
    def _count_accepted(self, token_ids: list[int]) -> int:
        index = self._compiled.index
        eos = self._compiled.eos_token_id
        state = self._state
        ended = self._ended
        count = 0
        for token in token_ids:
            if ended:
                break
            token = int(token)
            if eos is not None and token == eos:
                if not index.is_final_state(state):
                    break
                ended = True
            else:
                if not 0 <= token < 2**32:
                    break
                state = index.get_next_state(state, token)
                if state is None:
                    break
            count += 1
        return count

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if len(token_ids) == 1:  # every step of a constrained request without drafts
            return self._accept_one(int(token_ids[0]))
        if self._count_accepted(token_ids) != len(token_ids):
            return False
        for token in token_ids:
            self._accept_one(int(token))
        return True

    def _accept_one(self, token: int) -> bool:
        if self._ended:
            return False
        compiled = self._compiled
        if token == compiled.eos_token_id:
            if not compiled.index.is_final_state(self._state):
                return False
            self._ended = True
            return True
        if not 0 <= token < 2**32:
            return False
        state = compiled.index.get_next_state(self._state, token)
        if state is None:
            return False
        self._guide.advance(token, return_tokens=False)
        self._state = state
        self._tokens.append(token)
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self._count_accepted(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        available = len(self._tokens) + int(self._ended)
        if num_tokens > available:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {available} were accepted")
        if self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens == 0:
            return
        if num_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(num_tokens)
            del self._tokens[-num_tokens:]
        else:  # further back than the guide remembers: replay what stays on a fresh guide
            from outlines_core import Guide

            del self._tokens[-num_tokens:]
            guide = Guide(self._compiled.index, max_rollback=MAX_ROLLBACK)
            for token in self._tokens:
                guide.advance(token, return_tokens=False)
            self._guide = guide
        self._state = self._guide.get_state()

    # -------------------------------------------------------------- masking
    def mask_slot(self) -> int:
        """The mask table slot of the tokens allowed next (see :class:`runtime_outlines.masks.MaskTable`)."""
        if self._ended:
            return ENDED_SLOT  # complete: only EOS (the engine finishes the request before sampling again)
        slot = self._slots.get(self._state)
        if slot is None:
            # outlines-core clears the row, then sets the bit of every token allowed in this state
            # (EOS only in final states; special tokens and ids past the vocabulary never).
            slot = self._compiled.add_slot(self._guide, self._state)
        return slot

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError(
                f"fill_bitmask needs a 2-D CPU int32 bitmask (allocate_token_bitmask), got "
                f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        words = bitmask[row]
        if words.stride(0) != 1:
            raise ValueError("fill_bitmask needs the bitmask's rows contiguous in memory")
        masks = self._compiled.masks
        if words.numel() == masks.num_words:
            slot = self.mask_slot()  # first: a new slot may grow the table
            words.copy_(masks.rows[slot])
            masks.end_fill()
        elif self._ended:
            words.zero_()
            self._set_bit(words, self._compiled.end_token_id)
        else:  # a bitmask of another width than the backend's logits: not cached
            self._guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())

    @staticmethod
    def _set_bit(words: torch.Tensor, token: int) -> None:
        word, bit = divmod(token, 32)
        if word < words.numel():
            value = int(words[word]) & 0xFFFFFFFF
            value |= 1 << bit
            words[word] = value - (1 << 32) if value >= 1 << 31 else value

    # -------------------------------------------------------------- state
    def is_terminated(self) -> bool:
        return self._ended or self._compiled.only_end_allowed(self._state)

    def is_final(self) -> bool:
        """True where the output so far is complete (EOS allowed), even if it may go on."""
        return self._ended or self._compiled.index.is_final_state(self._state)

    def fork(self) -> "OutlinesGrammar":
        return OutlinesGrammar(self._compiled)

    @property
    def compiled(self) -> CompiledSpec:
        return self._compiled

    @property
    def num_accepted(self) -> int:
        return len(self._tokens) + int(self._ended)

    def __repr__(self) -> str:
        return (
            f"OutlinesGrammar({self._compiled.kind.value}, state={self._state}, "
            f"accepted={self.num_accepted}, terminated={self.is_terminated()})"
        )
