"""The speculative-decoding contract: a proposer drafts tokens, the engine verifies them.

A proposer plugin registers a factory through ``register_proposers``; the factory is called
as ``factory(config)`` with the :class:`runtime.config.EngineConfig` and must be cheap (it
runs in the engine core, and again in each worker for worker-side proposers). The engine
verifies the drafts: it spends them from the token budget, runs the target model on
``1 + k`` positions per request and keeps the accepted prefix (rejection sampling lives in
core, never in a proposer). A proposer whose model holds a limited number of positions (a draft
model) gives its factory an attribute ``max_positions``, a function of the resolved speculative_config
dict giving that number (or None): when the user sets no ``max_model_len``, the engine lowers the
target's to it (vLLM's behaviour); a larger explicit one is the proposer's to refuse. Two kinds of
proposer:

* **Host proposers** (``uses_kv_cache`` and ``needs_hidden_states`` both False, e.g.
  ``ngram``): after each step EngineCore hands :meth:`Proposer.propose` a
  :class:`ProposalBatch` of the requests that may speculate, and the drafts are scheduled
  with the next step.
* **Worker proposers** (either flag set: ``draft_model``, ``eagle``, ``medusa``): they run in
  the worker next to the target, inside the verification step. EngineCore only decides how
  many drafts each request gets (it schedules placeholders); the worker's model runner
  calls :meth:`WorkerProposer.load` once, then before the target's forward pass fills the
  placeholders with drafts, and gives the rejection sampler their probabilities q. So the
  drafts' KV slots are those the scheduler allocated for the verification step itself: no
  lookahead slots beyond them.

  - ``uses_kv_cache`` (draft_model, eagle): ``load`` returns a :class:`DraftModule`; the
    runner gives it a paged KV cache of its own (same block ids as the target's, so prefix
    caching, chunked prefill and preemption carry over; the engine sizes the cache for both),
    runs it over every token the target computes and k autoregressive passes per step.
  - ``needs_hidden_states`` without KV (medusa): ``load`` loads the heads; the runner calls
    ``propose`` with ``ProposalBatch.hidden_states`` set to the target's last accepted hidden
    state of each drafting request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

# The token id EngineCore schedules in place of each draft of a worker proposer; the worker
# overwrites it with the real draft before the target reads it.
DRAFT_PLACEHOLDER_ID = 0


@dataclass(slots=True)
class ProposalBatch:
    """What a proposer sees of one step, row ``i`` for request ``req_ids[i]``."""

    req_ids: list[str]
    token_ids: list[list[int]]  # prompt + output tokens of each request, accepted ones only
    num_speculative_tokens: int  # k: the most drafts per request
    # [num_reqs, hidden_size] the target's last hidden state of each request (the one its
    # newest token was sampled from), only for proposers with ``needs_hidden_states`` run in
    # the worker (medusa); None otherwise.
    hidden_states: torch.Tensor | None = None


@dataclass(slots=True)
class DraftProposals:
    """Draft tokens per request (possibly fewer than k, or none) and their probabilities."""

    token_ids: list[list[int]]
    # [num_reqs, k, vocab_size] the proposal distribution q of each draft, for proposers
    # that sample; None means q = 1 for the drafted token (ngram, greedy drafts).
    probs: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """Drafts up to k tokens per request.

    Optional flags (read with ``getattr``, default False): ``uses_kv_cache`` (the proposer
    runs a model with KV of its own, e.g. a draft model) and ``needs_hidden_states`` (it reads
    the target's hidden states). Either flag makes it a worker proposer (see the module
    docstring and :class:`WorkerProposer`).
    """

    def propose(self, batch: ProposalBatch) -> DraftProposals:
        """Draft tokens for every row of ``batch``, in its order."""


@dataclass(slots=True)
class TargetInfo:
    """What a worker proposer may read of the target when it loads (in the worker)."""

    model: torch.nn.Module  # the target (a runtime.models.interface.CausalLM), loaded
    hf_config: Any  # its transformers config
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    load_format: str  # the engine's load_format ("dummy": random weights for the proposer too)
    seed: int
    platform: Any = None  # the worker's runtime.platforms.Platform (a quant config checks it)


@runtime_checkable
class WorkerProposer(Protocol):
    """A proposer run by the worker (``uses_kv_cache`` or ``needs_hidden_states`` set).

    ``load`` is called once in each worker after the target is loaded. A proposer with
    ``uses_kv_cache`` returns its :class:`DraftModule` (the runner drives it; ``propose`` is
    not called); one without returns None and has ``propose`` called with hidden states.
    """

    def load(self, target: TargetInfo) -> DraftModule | None:
        """Load weights on ``target.device``; return the draft module, if it has KV."""

    def propose(self, batch: ProposalBatch) -> DraftProposals:
        """Draft tokens from ``batch.hidden_states`` (proposers without KV)."""


@runtime_checkable
class DraftModule(Protocol):
    """A small model with paged KV of its own, run autoregressively by the worker.

    Its attention layers read the forward context the runner sets (its own KV caches, layer
    ``i`` at index ``i``). ``target_hidden`` says what it reads of the target per position:
    ``None`` (nothing: a draft model), ``"last"`` (the target's final, normed hidden state:
    EAGLE-1) or a tuple of target layer indices whose inputs (the residual stream entering
    that layer) are concatenated (EAGLE-3).

    Position ``p`` of the module: a draft model reads token ``p`` (``input_shift = 0``); a
    module with target hidden states reads token ``p + 1`` and the target's hidden state of
    position ``p`` (``input_shift = 1``), and in later passes its own carried hidden state.
    """

    target_hidden: None | str | tuple[int, ...]
    input_shift: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids``/``positions`` [T] and hidden [T, H'] or None -> (hidden for the
        logits [T, H], hidden carried to the next pass [T, H] or None)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, target vocab_size] float logits (ids of the target's vocabulary)."""

    def attention_specs(self) -> list:
        """One runtime.attention.backend.AttentionLayerSpec per attention layer."""


def is_worker_proposer(proposer: Any) -> bool:
    """Whether ``proposer`` runs in the worker (see the module docstring)."""
    return bool(getattr(proposer, "uses_kv_cache", False) or getattr(proposer, "needs_hidden_states", False))
