"""Worker proposers (draft model, EAGLE, Medusa) run next to the target in each step.

EngineCore schedules placeholder drafts for them (see :mod:`runtime.spec_decode`); before
the target's forward pass :meth:`SpecDecodeRunner.propose` replaces the placeholders with
drafts (and their q), and after verification :meth:`SpecDecodeRunner.record` notes what the
step made valid:

* a draft module with ``input_shift = 0`` (draft model): ``valid[req]``, the positions whose
  draft KV holds accepted tokens; its catch-up pass covers ``[valid, end)``;
* a module that reads the target's hidden states (EAGLE): ``valid[req]`` and ``pending[req]``,
  the target's hidden states of positions ``[valid, computed)`` not yet fed to it;
* Medusa (no KV): ``pending[req]``, the target's last accepted hidden state.

A request seen for the first time (or again after preemption) starts at the target's
computed tokens: the draft KV of blocks it shares through the prefix cache was written when
the target computed them (one exception: the last draft of a fully accepted run is computed
by the module only in the next step, so a block completed by it and hit before then holds
stale draft KV there; drafts from it are only less likely to be accepted, never wrong).

Tensor parallelism: each rank loads the proposer in its tensor-parallel group (a draft model or
EAGLE head is sharded like the target, Medusa's heads are replicated) and drafts from the same
gathered logits, so greedy drafts and every q agree; sampled drafts are broadcast from the
group's first rank (see :mod:`runtime.worker.draft_passes`), and the verified tokens from the
output rank. Pipeline parallelism is refused: the last stage alone holds hidden states and logits.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from runtime.attention.backend import select_attention_backend
from runtime.config import EngineConfig
from runtime.messages import SchedulerOutput
from runtime.spec_decode import DraftModule, ProposalBatch, TargetInfo, is_worker_proposer
from runtime.worker.draft_passes import DraftRequest, PassRows, run_pass, sample_drafts

logger = logging.getLogger(__name__)


class StepDrafts:
    """The drafts of one step: per request id, and q rows in the verification order."""

    __slots__ = ("token_ids", "probs")

    def __init__(self, token_ids: dict[str, list[int]], probs: torch.Tensor | None):
        self.token_ids = token_ids
        self.probs = probs  # [sum(m_i), V] request-major in the step's order, or None (q = 1)


class SpecDecodeRunner:
    @classmethod
    def maybe_create(cls, config: EngineConfig, platform, device, target, block_table: np.ndarray):
        """The runner when speculation uses a worker proposer, else None."""
        spec = config.plugin_options.get("speculative_config")
        if not spec:
            return None
        from runtime.plugins import get_registry

        proposer = get_registry("proposer").create(spec["method"], config)
        if not is_worker_proposer(proposer):
            return None
        if not callable(getattr(proposer, "load", None)):
            flags = " and ".join(f for f in ("uses_kv_cache", "needs_hidden_states") if getattr(proposer, f, False))
            raise ValueError(
                f"speculative method {spec['method']!r}: its proposer sets {flags}, so it runs in the worker and must "
                "implement runtime.spec_decode.WorkerProposer (load(target) -> DraftModule or None)"
            )
        pipeline = config.parallel_config.pipeline_parallel_size
        if pipeline > 1:
            raise ValueError(
                f"speculative method {spec['method']!r} runs a proposer in the worker, which does not support pipeline "
                f"parallelism (the last stage alone holds the hidden states and logits); got pipeline_parallel_size "
                f"{pipeline}; use tensor_parallel_size (each rank runs the proposer on its shard)"
            )
        return cls(config, platform, device, target, block_table, proposer)

    def __init__(self, config: EngineConfig, platform, device, target, block_table: np.ndarray, proposer):
        mc = config.model_config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.block_table = block_table  # the input batch's host table, shared with the target
        self.proposer = proposer
        info = TargetInfo(target, mc.resolved.hf_config, mc.vocab_size, mc.dtype, device,
                          config.load_config.load_format, mc.seed, platform)
        self.module: DraftModule | None = proposer.load(info)
        self.kv_caches: list[torch.Tensor] = []
        self.valid: dict[str, int] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.written_end: dict[str, int] = {}
        self.captured: list[torch.Tensor] = []
        self.attn_backend = None
        if self.module is not None:
            self.specs = self.module.attention_specs()
            self.attn_backend = select_attention_backend(
                config.device_config.attention_backend, platform, mc.dtype, self.specs[0].head_size)
            self.kv_dtype = config.cache_config.kv_cache_torch_dtype(mc.dtype)
            layers = self.module.target_hidden
            if isinstance(layers, tuple):
                self._capture_layer_inputs(target, layers)
        self.shift = getattr(self.module, "input_shift", 0) if self.module is not None else 1
        self.reads_hidden = self.module is None or self.module.target_hidden is not None
        # The target's forward may replay a captured graph unless hooks read its layers (EAGLE-3).
        self.runs_in_graphs = not isinstance(getattr(self.module, "target_hidden", None), tuple)

    def _capture_layer_inputs(self, target, layers: tuple[int, ...]) -> None:
        """Keep the residual stream entering the target's decoder layers ``layers`` (EAGLE-3)."""
        decoder_layers = target.model.layers
        bad = [i for i in layers if not 0 <= i < len(decoder_layers)]
        if bad:
            raise ValueError(f"the proposer reads target layer {bad[0]}, but the target has {len(decoder_layers)} layers")

        def keep(module, args):
            hidden, residual = args[0], args[1]
            self.captured.append(hidden if residual is None else hidden + residual)

        for i in sorted(layers):
            decoder_layers[i].register_forward_pre_hook(keep)

    # ---------------------------------------------------------------- memory
    def memory_bytes(self) -> int:
        """The proposer's own weights (a module's or Medusa's heads), for the KV cache budget."""
        owner = self.module if self.module is not None else getattr(self.proposer, "heads", None)
        return sum(p.numel() * p.element_size() for p in owner.parameters()) if owner is not None else 0

    def kv_bytes_per_block(self) -> int:
        if self.module is None:
            return 0
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * s.num_kv_heads * s.head_size * elem for s in self.specs)

    def initialize_kv_cache(self, num_blocks: int, platform) -> None:
        if self.module is None:
            return
        self.kv_caches = [
            platform.allocate_kv_cache(
                self.attn_backend.kv_cache_shape(num_blocks, self.block_size, s.num_kv_heads, s.head_size),
                self.kv_dtype, self.device)
            for s in self.specs
        ]

    # ---------------------------------------------------------------- step
    def forget(self, finished_req_ids) -> None:
        """Drop what the runner keeps of finished requests (also on steps that schedule no token)."""
        for req_id in finished_req_ids:
            for table in (self.valid, self.pending, self.written_end):
                table.pop(req_id, None)

    def propose(self, so: SchedulerOutput, inputs, token_ids: np.ndarray) -> StepDrafts | None:
        """Drafts for the step's placeholders, written into ``inputs.input_ids`` and ``token_ids``
        (the input batch's host rows); runs the module's catch-up pass even with no drafts."""
        self.captured.clear()
        self.forget(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            self.valid[new.req_id] = new.num_computed_tokens
            self.pending.pop(new.req_id, None)
        spec = so.scheduled_spec_decode_tokens
        drafting = [
            DraftRequest(i, len(spec[s.req_id]), s.sampling_params.temperature if not s.sampling_params.is_greedy else 0.0,
                         s.sampling_params.seed, int(inputs.num_known[i]) - len(s.prompt_token_ids))
            for i, s in enumerate(inputs.states) if s.req_id in spec
        ]
        if self.module is None:
            draft_lists, probs = self._propose_from_hidden(inputs, drafting, token_ids), None
        else:
            draft_lists, probs = self._run_module(inputs, drafting, token_ids)
        if not drafting:
            return None
        result = {}
        index, values = [], []
        for request, drafts in zip(drafting, draft_lists):
            state = inputs.states[request.index]
            c0 = int(inputs.num_computed[request.index])
            token_ids[state.row, c0 + 1 : c0 + 1 + len(drafts)] = drafts
            first = int(inputs.query_start_loc[request.index]) + 1
            index.extend(range(first, first + len(drafts)))
            values.extend(drafts)
            result[state.req_id] = drafts
        inputs.input_ids[torch.tensor(index, device=self.device)] = torch.tensor(values, device=self.device)
        return StepDrafts(result, probs)

    def _propose_from_hidden(self, inputs, drafting: list[DraftRequest], token_ids: np.ndarray) -> list[list[int]]:
        """Medusa: drafts from each request's last accepted target hidden state."""
        if not drafting:
            return []
        states = [inputs.states[r.index] for r in drafting]
        able = [n for n, s in enumerate(states) if s.req_id in self.pending]  # not: first step after a resume
        proposed: dict[int, list[int]] = {}
        if able:
            k = max(drafting[n].num_drafts for n in able)
            hidden = torch.cat([self.pending[states[n].req_id][-1:] for n in able])
            batch = ProposalBatch([states[n].req_id for n in able],
                                  [token_ids[states[n].row, : inputs.num_tokens[drafting[n].index]].tolist() for n in able], k, hidden)
            proposed = dict(zip(able, self.proposer.propose(batch).token_ids))
        return [pad_drafts(list(proposed.get(n, [])), r.num_drafts, int(token_ids[s.row, inputs.num_tokens[r.index] - 1]))
                for n, (r, s) in enumerate(zip(drafting, states))]

    def _first_pass_rows(self, inputs, drafting: list[DraftRequest]) -> PassRows:
        num_drafts = np.zeros(len(inputs.states), dtype=np.int64)
        for r in drafting:
            num_drafts[r.index] = r.num_drafts
        c0 = inputs.num_computed.astype(np.int64)
        starts = np.fromiter((min(self.valid.get(s.req_id, 0), int(c)) for s, c in zip(inputs.states, c0)),
                             dtype=np.int64, count=len(c0))
        if self.shift == 0:
            ends = np.where(num_drafts > 0, c0 + 1, c0 + inputs.num_scheduled)
        else:
            ends = c0.copy()
            for i, s in enumerate(inputs.states):  # pending hidden states cover [valid, computed)
                pending = self.pending.get(s.req_id)
                if pending is None or starts[i] + pending.shape[0] != c0[i]:
                    starts[i] = c0[i]
                    self.pending.pop(s.req_id, None)
        self.ends = ends
        take = np.nonzero(ends > starts)[0]
        rows = np.fromiter((inputs.states[i].row for i in take), dtype=np.int64, count=len(take))
        return PassRows(take, rows, starts[take], (ends - starts)[take])

    def _run_module(self, inputs, drafting: list[DraftRequest], token_ids: np.ndarray):
        module, device = self.module, self.device
        first = self._first_pass_rows(inputs, drafting)
        runs = {int(i): n for n, i in enumerate(first.req_index)}
        able = [r for r in drafting if r.index in runs]
        draft_lists: dict[int, list[int]] = {r.index: [] for r in drafting}
        prob_rows: dict[int, list[torch.Tensor]] = {r.index: [] for r in drafting}
        if len(first.req_index):
            owner = np.repeat(np.arange(len(first.req_index)), first.counts)
            positions = np.arange(int(first.counts.sum())) - np.repeat(np.cumsum(first.counts) - first.counts, first.counts)
            positions = positions + first.starts[owner]
            ids = torch.from_numpy(token_ids[first.rows[owner], positions + self.shift]).to(device)
            hidden = None
            if self.reads_hidden:
                hidden = torch.cat([self.pending[inputs.states[i].req_id] for i in first.req_index])
            out, carry, last_rows = run_pass(module, self.attn_backend, self.kv_caches, first, ids, hidden,
                                             self.block_table, self.block_size, device)
            if able:
                pick = torch.tensor([int(last_rows[runs[r.index]]) for r in able], device=device)
                tokens, probs = sample_drafts(module.compute_logits(out[pick]), able, 0)
                carry = carry[pick] if carry is not None else None
                self._collect(able, tokens, probs, draft_lists, prob_rows)
                self._more_passes(inputs, able, tokens, carry, draft_lists, prob_rows)
        drafts = [pad_drafts(draft_lists[r.index], r.num_drafts, int(token_ids[inputs.states[r.index].row, int(inputs.num_computed[r.index])]))
                  for r in drafting]
        for r in drafting:  # the draft model's KV now reaches its last fed draft
            self.written_end[inputs.states[r.index].req_id] = int(self.ends[r.index]) + max(len(draft_lists[r.index]) - 1, 0)
        probs = None
        if any(prob_rows[r.index] for r in drafting):  # q of random requests; greedy drafts have q = 1
            vocab = next(p for r in drafting for p in prob_rows[r.index]).shape[-1]
            probs = torch.cat([torch.stack(prob_rows[r.index]) if len(prob_rows[r.index]) == len(d) else one_hot(d, vocab, device)
                               for r, d in zip(drafting, drafts)])
        return drafts, probs

    def _more_passes(self, inputs, able, tokens, carry, draft_lists, prob_rows) -> None:
        """Draft passes 1 .. m - 1: one token per request still drafting."""
        for j in range(1, max(r.num_drafts for r in able)):
            keep = [n for n, r in enumerate(able) if r.num_drafts > j]
            if not keep:
                return
            able = [able[n] for n in keep]
            keep_t = torch.tensor(keep, device=self.device)
            tokens = tokens[keep_t]
            carry = carry[keep_t] if carry is not None else None
            rows = PassRows(
                np.array([r.index for r in able]),
                np.array([inputs.states[r.index].row for r in able], dtype=np.int64),
                np.array([int(self.ends[r.index]) - 1 + j for r in able], dtype=np.int64),
                np.ones(len(able), dtype=np.int64),
            )
            out, carry, _ = run_pass(self.module, self.attn_backend, self.kv_caches, rows, tokens, carry,
                                     self.block_table, self.block_size, self.device)
            tokens, probs = sample_drafts(self.module.compute_logits(out), able, j)
            self._collect(able, tokens, probs, draft_lists, prob_rows)

    @staticmethod
    def _collect(requests, tokens, probs, draft_lists, prob_rows) -> None:
        for n, (r, t) in enumerate(zip(requests, tokens.tolist())):
            draft_lists[r.index].append(t)
            if probs is not None and r.temperature > 0:
                prob_rows[r.index].append(probs[n])

    def record(self, inputs, hidden: torch.Tensor, num_valid: dict[str, int] | None = None) -> None:
        """After the step: request ``i`` made ``num_valid[req_id]`` (default: all its scheduled)
        of its computed positions valid; ``hidden`` [num_tokens, H] is the target's output."""
        num_valid = num_valid or {}
        if self.reads_hidden and isinstance(getattr(self.module, "target_hidden", None), tuple):
            hidden = torch.cat(self.captured, dim=-1)
        self.captured.clear()
        for i, state in enumerate(inputs.states):
            c0 = int(inputs.num_computed[i])
            n = num_valid.get(state.req_id, int(inputs.num_scheduled[i]))
            if not self.reads_hidden:
                self.valid[state.req_id] = min(self.written_end.pop(state.req_id, int(self.ends[i])), c0 + n)
                continue
            start = int(inputs.query_start_loc[i])
            if self.module is None:  # Medusa: the last accepted hidden state only
                self.pending[state.req_id] = hidden[start + n - 1 : start + n].clone()
                continue
            self.pending[state.req_id] = hidden[start : start + n].clone()  # positions [c0, c0 + n)
            self.valid[state.req_id] = c0  # the catch-up pass fed it everything before


def pad_drafts(drafts: list[int], count: int, filler: int) -> list[int]:
    """Exactly ``count`` drafts: a proposer that gave fewer is padded with ``filler`` (a
    deterministic draft, q = 1: verified like any other)."""
    return (drafts + [filler] * count)[:count]


def one_hot(tokens: list[int], vocab: int, device) -> torch.Tensor:
    rows = torch.zeros(len(tokens), vocab, device=device)
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] = 1.0
    return rows
