"""A guided backend over token ids, for engine tests that must not depend on a real backend.

Its ``choice`` spec is a JSON list of strings of space-separated token ids (``["5 6 7", "5 9"]``):
the output must be one of those token sequences, then EOS. The regex spec ``"fail"`` fails to
compile and ``"slow:<seconds>"`` compiles that slowly, so tests can drive the engine's error paths.
"""

from __future__ import annotations

import json
import time

import runtime
from runtime.structured_output import GuidedKind

BACKEND_NAME = "token_trie"


class TrieGrammar:
    def __init__(self, sequences: list[tuple[int, ...]], eos_token_id: int):
        self.sequences = sequences
        self.eos = eos_token_id
        self.state: list[int] = []
        self.ended = False  # EOS accepted
        self.num_bitmask_fills = 0

    def _allowed(self, state: list[int]) -> set[int]:
        n = len(state)
        allowed = {s[n] for s in self.sequences if len(s) > n and list(s[:n]) == state}
        if tuple(state) in self.sequences:
            allowed.add(self.eos)
        return allowed

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self.validate_tokens(token_ids) != len(token_ids):
            return False
        for token in token_ids:
            if token == self.eos:
                self.ended = True
            else:
                self.state.append(token)
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        state = list(self.state)
        for count, token in enumerate(token_ids):
            if self.ended or token not in self._allowed(state):
                return count
            if token == self.eos:
                return count + 1
            state.append(token)
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.ended:
            self.ended = False
            num_tokens -= 1
        del self.state[len(self.state) - num_tokens :]

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.num_bitmask_fills += 1
        bitmask[row] = 0
        for token in self._allowed(self.state):
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def is_terminated(self) -> bool:
        return self.ended or self._allowed(self.state) == {self.eos}

    def fork(self) -> "TrieGrammar":
        return TrieGrammar(self.sequences, self.eos)


class TrieBackend:
    def __init__(self, tokenizer, vocab_size: int):
        self.eos = tokenizer.eos_token_id
        self.vocab_size = vocab_size

    def compile(self, kind: GuidedKind, spec: str) -> TrieGrammar:
        if kind == GuidedKind.REGEX and spec == "fail":
            raise ValueError("this regex is not supported by the token_trie backend")
        if kind == GuidedKind.REGEX and spec.startswith("slow:"):
            time.sleep(float(spec.split(":")[1]))
            return TrieGrammar([(1,)], self.eos)
        if kind != GuidedKind.CHOICE:
            raise ValueError(f"token_trie compiles only choice specs, not {kind.value}")
        sequences = [tuple(int(t) for t in choice.split()) for choice in json.loads(spec)]
        bad = [t for s in sequences for t in s if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary")
        return TrieGrammar(sequences, self.eos)


class TrieBackendPlugin:
    @staticmethod
    @runtime.hookimpl
    def register_guided_backends(register):
        register(BACKEND_NAME, TrieBackend)


def choice_spec(sequences: list[list[int]]) -> list[str]:
    return [" ".join(str(t) for t in s) for s in sequences]
