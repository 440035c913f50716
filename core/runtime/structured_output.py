"""The structured-output contract: a guided backend compiles specs into grammars.

A plugin registers a factory through ``register_guided_backends``; the engine builds one
:class:`GuidedBackend` per tokenizer with ``factory(tokenizer, vocab_size)`` (the model's
transformers tokenizer and the width of its logits, which may exceed the tokenizer's
vocabulary). The engine compiles each distinct (kind, spec) once, off the step loop, into a
:class:`Grammar`, and gives every request its own :meth:`Grammar.fork` of it. Each step the
grammars of the constrained rows fill a token bitmask that is applied to the logits on the
device before sampling; sampled tokens advance the grammar with :meth:`Grammar.accept_tokens`,
and the request finishes once :meth:`Grammar.is_terminated`.

A backend may fill the rows of a whole step at once (``fill_bitmask_batch``, optional: see
:func:`fill_bitmask_batch`). The scheduler hands the step's bitmask to the worker as a
:class:`DeferredBitmask`, which the model runner fills after it has queued the forward pass,
so that the host fills rows while the device computes (with async scheduling, the engine
first collects the previous step there, so that the grammars have seen its tokens).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


class GuidedKind(str, enum.Enum):
    """What a spec string holds."""

    JSON = "json"  # a JSON schema, serialized
    JSON_OBJECT = "json_object"  # any JSON object (spec ignored)
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of strings, one of which is the whole output
    GRAMMAR = "grammar"  # an EBNF / Lark grammar, where the backend supports it


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, ceil(vocab_size / 32)]`` int32, every token allowed: bit ``t % 32`` of word
    ``t // 32`` is set when token ``t`` may be sampled."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


@runtime_checkable
class Grammar(Protocol):
    """One request's constraint, advanced token by token."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and no change) if the grammar rejects any."""

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar would accept, without advancing
        (speculative drafts are checked with this)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (see :func:`allocate_token_bitmask`);
        EOS is allowed only where the grammar may end."""

    def is_terminated(self) -> bool:
        """True once the output is complete (the request finishes): EOS was accepted, or the
        grammar is in a final state that no token but EOS can extend."""

    def fork(self) -> "Grammar":
        """A new grammar for the same spec at its start state, sharing the compiled automaton
        (one per request; compiling is the expensive part)."""


@runtime_checkable
class GuidedBackend(Protocol):
    """Compiles specs for one tokenizer's vocabulary."""

    def compile(self, kind: GuidedKind, spec: str) -> Grammar:
        """A fresh grammar for ``spec``; raise ValueError naming the problem for a bad spec."""


def fill_bitmask_batch(backend: object, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
    """Fill row ``i`` of ``bitmask`` for ``grammars[i]``, every row, exactly as
    ``grammars[i].fill_bitmask(bitmask, i)`` would.

    A backend whose grammars all come from it may implement ``fill_bitmask_batch(grammars,
    bitmask)`` with this meaning (optional: it is not part of :class:`GuidedBackend`, so a
    backend without it keeps working); it is called when present, else each grammar fills its
    own row.
    """
    batch = getattr(backend, "fill_bitmask_batch", None)
    if batch is not None:
        batch(grammars, bitmask)
        return
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask, row)


class DeferredBitmask:
    """A step's token bitmask, filled on first use: ``fill()`` (called once) returns the filled
    tensor; :meth:`tensor` calls it the first time and returns the same tensor afterwards.

    The model runner asks for it after queueing the forward pass, so the host fills the rows
    while the device computes. Pickled (a worker in another process), it is filled first and
    arrives as the plain tensor.

    ``before_fill``, when set, is called once just before ``fill()``: with async scheduling the
    engine sets it to collect the step still in flight, whose tokens the grammars must see
    before they can say which tokens may follow.
    """

    __slots__ = ("_fill", "_tensor", "before_fill")

    def __init__(self, fill: Callable[[], torch.Tensor]):
        self._fill = fill
        self._tensor: torch.Tensor | None = None
        self.before_fill: Callable[[], object] | None = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            before, self.before_fill = self.before_fill, None
            if before is not None:
                before()
            self._tensor, self._fill = self._fill(), None
        return self._tensor

    @property
    def is_filled(self) -> bool:
        return self._tensor is not None

    def __reduce__(self):
        return (_same, (self.tensor(),))


def _same(value):
    return value


def resolve_bitmask(bitmask: torch.Tensor | DeferredBitmask) -> torch.Tensor:
    """The filled tensor of a step's ``grammar_bitmask`` (a tensor, or a :class:`DeferredBitmask`)."""
    return bitmask if isinstance(bitmask, torch.Tensor) else bitmask.tensor()
