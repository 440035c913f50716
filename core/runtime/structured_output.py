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

A backend that keeps one row per grammar state in a table may instead name each row's table
row (``bitmask_slots``, optional: see :class:`SlotBitmask`): the worker keeps a copy of the
table on the device, uploads only the rows it has not seen, and the mask is applied through
the slots, so a step moves a few bytes per row instead of ``ceil(V / 32)`` words.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
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
    import torch

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


@runtime_checkable
class IsolatedCompileBackend(GuidedBackend, Protocol):
    """A :class:`GuidedBackend` whose expensive part of a compile can run in another process
    (optional): the engine then runs it in a child process under a memory limit, killed at the
    compile's time limit (see :mod:`runtime.scheduler.grammar_sandbox`), so that no spec can
    exhaust the engine's memory or keep a compile running past its limit.

    ``compile(kind, spec)`` must equal ``load_compiled(kind, spec, isolated_compiler()(kind, spec))``.
    """

    def isolated_compiler(self) -> Callable[[str, str], object]:
        """A picklable callable ``(kind value, spec) -> artifact`` (picklable too), raising ValueError
        naming the problem for a bad spec. It is unpickled in a fresh Python process, so its module
        should import little (not torch): the process starts again after a compile is killed."""

    def load_compiled(self, kind: GuidedKind, spec: str, artifact: object) -> Grammar:
        """The grammar of ``spec`` from the artifact its isolated compile returned (cheap)."""


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


class SlotBitmask:
    """A step's bitmask as rows of a backend's mask table: row ``i`` allows what table row
    ``slots[i]`` allows (every token where ``slots[i] < 0``).

    ``rows`` is the table as it was when the slots were taken (``[capacity, words]`` CPU int32;
    rows ``[0, count)`` written). A backend never rewrites a written row of a table while its
    ``generation`` stays the same (rows are appended; a table that starts over gets a new
    generation), so a copy of rows ``[0, n)`` made earlier under the same ``(table_id,
    generation)`` is still valid and only rows ``[n, count)`` need copying.
    """

    __slots__ = ("rows", "count", "table_id", "generation", "slots")

    def __init__(self, rows: torch.Tensor, count: int, table_id: int, generation: int, slots: np.ndarray):
        self.rows = rows
        self.count = count
        self.table_id = table_id
        self.generation = generation
        self.slots = slots  # int32, one per bitmask row

    def with_slots(self, slots: np.ndarray) -> "SlotBitmask":
        return SlotBitmask(self.rows, self.count, self.table_id, self.generation, slots)

    def dense(self) -> torch.Tensor:
        """The same bitmask as a new ``[len(slots), words]`` tensor (see :func:`allocate_token_bitmask`)."""
        return gather_slot_rows(self.rows, self.slots)


def gather_slot_rows(table: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """A new ``[len(slots), words]`` int32 CPU tensor: row ``i`` is row ``slots[i]`` of the CPU
    ``table``, or every token allowed (every bit set) where ``slots[i] < 0``. In numpy: it runs on
    the calling thread, not split over torch's intra-op threads."""
    slots = np.asarray(slots, dtype=np.intp)
    out = np.full((len(slots), table.shape[1]), -1, dtype=np.int32)
    live = slots >= 0
    out[live] = table.numpy()[slots[live]]
    import torch

    return torch.from_numpy(out)


def bitmask_slots(backend: object, grammars: Sequence[Grammar]) -> SlotBitmask | None:
    """The step's bitmask for ``grammars`` as table slots, where ``backend`` implements
    ``bitmask_slots(grammars) -> SlotBitmask`` (optional, with that meaning; row ``i`` allows
    exactly what ``grammars[i].fill_bitmask`` would); None where it does not."""
    method = getattr(backend, "bitmask_slots", None)
    return None if method is None else method(grammars)


class DeferredBitmask:
    """A step's token bitmask, filled on first use: ``fill()`` (called once) returns the filled
    tensor; :meth:`tensor` calls it the first time and returns the same tensor afterwards.

    The model runner asks for it after queueing the forward pass, so the host fills the rows
    while the device computes. Pickled (a worker in another process), it is filled first and
    arrives as the plain tensor.

    ``fill_slots``, when given, returns the same bitmask as a :class:`SlotBitmask` (or None);
    :meth:`value` prefers it for a caller that can apply slots.

    ``before_fill``, when set, is called once just before the fill: with async scheduling the
    engine sets it to collect the step still in flight, whose tokens the grammars must see
    before they can say which tokens may follow.
    """

    __slots__ = ("_fill", "_fill_slots", "_value", "before_fill")

    def __init__(self, fill: Callable[[], torch.Tensor], fill_slots: Callable[[], SlotBitmask | None] | None = None):
        self._fill = fill
        self._fill_slots = fill_slots
        self._value: torch.Tensor | SlotBitmask | None = None
        self.before_fill: Callable[[], object] | None = None

    def value(self, slots_ok: bool = False) -> torch.Tensor | SlotBitmask:
        """The filled bitmask: a :class:`SlotBitmask` where ``slots_ok`` and the backend gives
        slots (decided by the first call), else the tensor."""
        if self._value is None:
            before, self.before_fill = self.before_fill, None
            if before is not None:
                before()
            if slots_ok and self._fill_slots is not None:
                self._value = self._fill_slots()
            if self._value is None:
                self._value = self._fill()
            self._fill = self._fill_slots = None
        return self._value

    def tensor(self) -> torch.Tensor:
        value = self.value()
        if isinstance(value, SlotBitmask):
            value = self._value = value.dense()
        return value

    @property
    def is_filled(self) -> bool:
        return self._value is not None

    def __reduce__(self):
        return (_same, (self.tensor(),))


def _same(value):
    return value


def resolve_bitmask(bitmask: torch.Tensor | DeferredBitmask, slots_ok: bool = False) -> torch.Tensor | SlotBitmask:
    """The filled value of a step's ``grammar_bitmask`` (a tensor, or a :class:`DeferredBitmask`):
    a tensor, or a :class:`SlotBitmask` where ``slots_ok`` and the backend gives slots."""
    if not isinstance(bitmask, DeferredBitmask):  # a tensor
        return bitmask
    return bitmask.value(slots_ok) if slots_ok else bitmask.tensor()
