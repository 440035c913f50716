"""Runs the model on one device: one flat batch per step, then sampling."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from runtime.attention.backend import AttentionMetadata, kv_block_layout, select_attention_backend
from runtime.config import EngineConfig
from runtime.distributed import broadcast_from_last_stage, get_parallel_state
from runtime.messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from runtime.forward_context import set_forward_context
from runtime.kv_transfer import KVConnectorRole, make_kv_connector
from runtime.models.layers import apply_kv_scales
from runtime.models.ops import custom_ops_scope, lookup
from runtime.sample.bitmask import DeviceMaskTable, apply_token_bitmask, takes_slots
from runtime.sample.metadata import greedy_metadata
from runtime.sample.upload import upload
from runtime.structured_output import SlotBitmask, resolve_bitmask
from runtime.worker.graphs import DecodeGraphs, can_capture
from runtime.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from runtime.worker.pending import PendingOutput

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_CHUNK = 512  # positions per logits matmul when computing prompt logprobs


class ModelRunner:
    def __init__(self, config: EngineConfig, platform, device: torch.device):
        self.config = config
        self.platform = platform
        self.device = device
        self.model_config = config.model_config
        self.block_size = config.cache_config.block_size
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs,
            self.model_config.max_model_len,
            self.block_size,
            device,
            config.scheduler_config.max_num_batched_tokens,
        )
        self.graphs: DecodeGraphs | None = None
        parallel = get_parallel_state()
        self.world_size, self.num_stages, self.is_last_stage = parallel.world_size, parallel.pp_size, parallel.is_last_stage
        self.kv_connector = None  # the KV connector's worker half (offload tiers), once the cache exists
        self.spec_runner = None  # a worker proposer (draft model, EAGLE, Medusa) beside the target

    # ---------------------------------------------------------------- setup
    def load_model(self) -> None:
        from runtime.model_loader import load_model
        from runtime.sample.rejection_sampler import RejectionSampler
        from runtime.sample.sampler import Sampler

        mc = self.model_config
        # Modules pick up the platform's fused kernels (if any) while they are built.
        with custom_ops_scope(self.platform.custom_ops()):
            self.model = load_model(
                mc.resolved, load_format=self.config.load_config.load_format, dtype=mc.dtype, device=self.device, seed=mc.seed
            )
            self.sampler = Sampler()
            self.rejection_sampler = RejectionSampler()
            self.apply_token_bitmask = lookup("apply_token_bitmask") or apply_token_bitmask  # a fused kernel if offered
            # Bitmasks as slots of a device copy of the backend's table, where the op takes slots.
            self.mask_table = DeviceMaskTable(self.device) if takes_slots(self.apply_token_bitmask) else None
            from runtime.worker.spec_decode_runner import SpecDecodeRunner

            self.spec_runner = SpecDecodeRunner.maybe_create(
                self.config, self.platform, self.device, self.model, self.input_batch.block_table)
        self.attention_specs = self.model.attention_specs()
        head_size = self.attention_specs[0].head_size
        self.attn_backend = select_attention_backend(
            self.config.device_config.attention_backend, self.platform, mc.dtype, head_size
        )
        self.input_batch.width_multiple = getattr(self.attn_backend, "block_table_width_multiple", 1)
        cache_dtype = self.config.cache_config.cache_dtype
        if cache_dtype != "auto" and not getattr(self.attn_backend, "supports_fp8_kv_cache", False):
            raise ValueError(
                f"attention backend {self.attn_backend.name!r} does not support kv_cache_dtype {cache_dtype!r}; "
                "use kv_cache_dtype 'auto' or a backend that does (cpu_paged, triton, sdpa)"
            )
        scaled = apply_kv_scales(self.model, cache_dtype != "auto")
        if scaled:
            logger.info("8-bit KV cache with the checkpoint's per-tensor scales (%d attention layers)", scaled)

    def model_memory_bytes(self) -> int:
        proposer = self.spec_runner.memory_bytes() if self.spec_runner is not None else 0  # a draft model's weights
        return proposer + sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.config.cache_config.kv_cache_torch_dtype(self.model_config.dtype)

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        proposer = self.spec_runner.kv_bytes_per_block() if self.spec_runner is not None else 0  # its KV shares block ids
        return proposer + sum(2 * self.block_size * s.num_kv_heads * s.head_size * elem for s in self.attention_specs)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override:
            num_blocks = cache.num_gpu_blocks_override
        else:
            available = self.platform.kv_cache_memory_bytes(cache, self.model_memory_bytes())
            num_blocks = available // self.kv_bytes_per_block()
        max_len = self.model_config.max_model_len
        if num_blocks * self.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} = {num_blocks * self.block_size} tokens, "
                f"fewer than max_model_len ({max_len}); give it more memory (kv_cache_memory_bytes / "
                "num_gpu_blocks_override) or lower max_model_len"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [
            self.platform.allocate_kv_cache(
                self.attn_backend.kv_cache_shape(num_blocks, self.block_size, s.num_kv_heads, s.head_size),
                self.kv_cache_dtype,
                self.device,
            )
            for s in self.attention_specs
        ]
        self.num_blocks = num_blocks
        if self.spec_runner is not None:
            self.spec_runner.initialize_kv_cache(num_blocks, self.platform)
        layout = kv_block_layout(self.attn_backend, self.kv_cache_dtype)
        cache_config = dataclasses.replace(self.config.cache_config, kv_block_layout=layout)
        self.kv_connector = make_kv_connector(dataclasses.replace(self.config, cache_config=cache_config),
                                              KVConnectorRole.WORKER)
        if self.kv_connector is not None:
            caches = self.kv_caches
            if self.spec_runner is not None and getattr(self.kv_connector, "stores_draft_kv", False):
                caches = caches + self.spec_runner.kv_caches  # the drafter's layers, on the same block ids
            self.kv_connector.register_kv_caches(caches, block_dim=self._block_dim())
        self.capture_graphs()
        self.warm_up_sampling()

    @torch.inference_mode()
    def warm_up_sampling(self) -> None:
        """Compute logits and sample once on each path a step takes, at one row (the lm_head's one-row kernel)
        and two: argmax-only rows in the lm_head's dtype, a greedy row with logprobs over float logits, and random
        rows (top-k and top-p) with generators of their own. The platform's kernels for them compile now
        rather than inside the first requests (W2's first timed step ran ~1 s long on a fresh H200, session 30).
        Touches no request's state and not the global random generator."""
        if not self.is_last_stage:  # the last stage computes the logits
            return
        from runtime.sample.metadata import build_sampling_metadata
        from runtime.sampling_params import SamplingParams

        hidden_size = self.model_config.hf_config.get_text_config().hidden_size
        argmax_logits = getattr(self.model, "compute_logits_for_argmax", self.model.compute_logits)
        random = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
        for rows, params in ((1, [SamplingParams(temperature=0.0, logprobs=1)]), (2, [random] * 2)):
            hidden = torch.zeros(rows, hidden_size, dtype=self.model_config.dtype, device=self.device)
            self.sampler(argmax_logits(hidden), greedy_metadata(rows))
            # every random row seeded: a batch with an unseeded one would draw from the global generator
            generators = [torch.Generator(device=self.device).manual_seed(0) for _ in params]
            metadata = build_sampling_metadata(params, [[0]] * rows, [[]] * rows, generators,
                                               self.model_config.vocab_size, self.device)
            self.sampler(self.model.compute_logits(hidden), metadata)
        self.platform.synchronize()

    def _block_dim(self) -> int:
        """The dimension of the backend's KV cache layout that indexes blocks."""
        spec = self.attention_specs[0]
        one, two = (self.attn_backend.kv_cache_shape(n, self.block_size, spec.num_kv_heads, spec.head_size) for n in (1, 2))
        return next(d for d, (a, b) in enumerate(zip(one, two)) if a != b)

    def capture_graphs(self) -> None:
        """Record decode steps as graphs when the platform and the attention backend allow it."""
        sizes = self.config.device_config.cuda_graph_sizes
        reason = can_capture(self.platform, self.attn_backend, sizes)
        if reason is None and self.num_stages > 1:
            reason = "pipeline stages hand activations over outside the graph"
        if reason is None and self.spec_runner is not None and not self.spec_runner.runs_in_graphs:
            reason = "the speculative proposer reads the target's layers through hooks, which a replayed graph skips"
        if reason is not None:
            logger.info("running eagerly: %s", reason)
            return
        spec = self.config.plugin_options.get("speculative_config")
        self.graphs = DecodeGraphs(
            sizes, self.platform, self.model, self.attn_backend, self.kv_caches,
            self.input_batch.buffers, self.block_size, self.model_config.max_model_len,
            verify_len=1 + int(spec["num_speculative_tokens"]) if spec else 0,
            max_num_tokens=self.input_batch.buffers.input_ids.host.shape[0],
        )
        self.graphs.capture()

    # ---------------------------------------------------------------- step
    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        metadata = AttentionMetadata(
            num_reqs=len(inputs.states),
            num_tokens=int(inputs.query_start_loc[-1]),
            max_query_len=int(inputs.num_scheduled.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc=inputs.query_start_loc_t,
            seq_lens=inputs.seq_lens_t,
            block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping,
            query_start_loc_cpu=inputs.query_start_loc,
            seq_lens_cpu=inputs.seq_lens,
            block_size=self.block_size,
        )
        return self.attn_backend.build_metadata(metadata)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingOutput:
        """Queue the step's work on the device; its sampled tokens come with ``result()``.

        The next step may be launched before this one's result is read: a request whose
        newest token is still on the device reads it from there (see InputBatch.prepare).
        """
        batch = self.input_batch
        batch.update_states(so)
        connector = self.kv_connector if so.kv_connector_metadata is not None else None
        if connector is not None:
            connector.start_load_kv(so.kv_connector_metadata)  # this step's loads land before the forward pass
        if so.total_num_scheduled_tokens == 0:
            if self.spec_runner is not None:
                self.spec_runner.forget(so.finished_req_ids)
            if connector is not None:
                connector.wait_for_save()
            return PendingOutput.done(ModelRunnerOutput([], []))
        inputs = batch.prepare(so, self.graphs.shape if self.graphs is not None else None)
        drafts = self.spec_runner.propose(so, inputs, batch.token_ids) if self.spec_runner is not None else None
        if inputs.graph_size is not None:
            hidden = self.graphs.run(inputs.graph_size)[: so.total_num_scheduled_tokens]
        else:
            with set_forward_context(self.attn_backend, self._metadata(inputs), self.kv_caches):
                hidden = self.model(inputs.input_ids, inputs.positions_t)  # [num_tokens, hidden]
        if so.grammar_bitmask is not None and self.is_last_stage:
            # the host fills the grammars' rows while the device runs the forward pass
            resolve_bitmask(so.grammar_bitmask, slots_ok=self.mask_table is not None)
        if connector is not None:
            connector.wait_for_save()  # saves that overlapped the forward pass have read their blocks
        if not self.is_last_stage:
            return self._receive_sampled(inputs)
        if self.spec_runner is not None and not so.scheduled_spec_decode_tokens:
            self.spec_runner.record(inputs, hidden)  # every scheduled token is valid
        plain = inputs.plain_greedy
        prompt_logprobs = {} if plain else self._prompt_logprobs(inputs, hidden)
        sample_rows = np.nonzero(inputs.sample_mask)[0]
        if len(sample_rows) == 0:
            return PendingOutput.done(ModelRunnerOutput([], [], None, prompt_logprobs))
        states, req_ids, rows = _sampling(inputs, sample_rows)
        if so.scheduled_spec_decode_tokens:
            return self._verify_drafts(so, inputs, hidden, states, sample_rows, plain, prompt_logprobs, drafts)
        compute_logits = self.model.compute_logits
        if plain and so.grammar_bitmask is None:  # rows that take the argmax alone
            compute_logits = getattr(self.model, "compute_logits_for_argmax", compute_logits)
        if len(sample_rows) == hidden.shape[0]:  # a decode step: every token is sampled
            logits = compute_logits(hidden)  # [num_sampled, vocab]
        else:
            last_token = upload(inputs.query_start_loc[1:][sample_rows] - 1, torch.int64, self.device)
            logits = compute_logits(hidden[last_token])
        if so.grammar_bitmask is not None:
            self._apply_grammar_bitmask(so, states, logits)
        metadata = greedy_metadata(len(states)) if plain else self._sampling_metadata(states)
        sampler_output = self.sampler(logits, metadata)
        if self.world_size > 1:  # every rank continues from the output rank's tokens (earlier stages have none)
            broadcast_from_last_stage(sampler_output.sampled_token_ids)
        batch.sampled_on_device(rows, sampler_output.sampled_token_ids)
        download = batch.buffers.start_download(sampler_output.sampled_token_ids)
        return PendingOutput(batch, states, req_ids, rows, download, sampler_output.logprobs, prompt_logprobs)

    def _receive_sampled(self, inputs: StepInputs) -> PendingOutput:
        """An earlier pipeline stage's step: its activations went on; the last stage's sampled
        tokens come back (the input batch needs them), without logits or logprobs."""
        sample_rows = np.nonzero(inputs.sample_mask)[0]
        if len(sample_rows) == 0:
            return PendingOutput.done(ModelRunnerOutput([], []))
        states, req_ids, rows = _sampling(inputs, sample_rows)
        token_ids = broadcast_from_last_stage(torch.empty(len(states), dtype=torch.int64, device=self.device))
        self.input_batch.sampled_on_device(rows, token_ids)
        download = self.input_batch.buffers.start_download(token_ids)
        return PendingOutput(self.input_batch, states, req_ids, rows, download, None, {})

    def _verify_drafts(
        self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor, states: list[CachedRequestState],
        sample_rows: np.ndarray, plain: bool, prompt_logprobs: dict[str, LogprobsLists], drafts=None,
    ) -> PendingOutput:
        """A step with speculative drafts: logits at the last ``1 + k_i`` positions of each
        sampling request, verified by the rejection sampler (``k_i = 0`` rows get the Sampler's
        token). Emits a variable number of tokens per request, so it reads them back at once.
        ``drafts``: a worker proposer's StepDrafts, which replace the scheduled placeholders."""
        spec = so.scheduled_spec_decode_tokens if drafts is None else drafts.token_ids
        num_drafts = [len(spec.get(s.req_id, ())) for s in states]
        counts = np.asarray(num_drafts, dtype=np.int64) + 1
        row_end = np.cumsum(counts)  # exclusive end of each request's logits rows
        token_end = inputs.query_start_loc[1:][sample_rows].astype(np.int64)  # exclusive end of its tokens
        # logits row t of request i reads token t + (token_end[i] - row_end[i]): its last counts[i] tokens
        index = np.arange(int(row_end[-1]), dtype=np.int64) + np.repeat(token_end - row_end, counts)
        logits = self.model.compute_logits(hidden[upload(index, torch.int64, self.device)])
        if so.grammar_bitmask is not None:
            # Constrained requests get no drafts: their one row is their last.
            self._apply_grammar_bitmask(so, states, logits, (row_end - 1).tolist())
        metadata = greedy_metadata(len(states)) if plain else self._sampling_metadata(states)
        draft_ids = upload([t for s in states for t in spec.get(s.req_id, ())], torch.int64, self.device)
        output = self.rejection_sampler(logits, draft_ids, num_drafts, metadata, drafts.probs if drafts is not None else None)
        if self.world_size > 1:  # every rank keeps the output rank's tokens, as after plain sampling
            broadcast_from_last_stage(output.output_token_ids)
            broadcast_from_last_stage(output.num_accepted)
        token_lists = output.token_lists()
        if self.spec_runner is not None:  # a request with m drafts computed 1 + accepted valid positions
            self.spec_runner.record(inputs, hidden, {s.req_id: len(t) for s, t in zip(states, token_lists) if s.req_id in spec})
        self.input_batch.receive_token_lists(states, token_lists)
        logprobs = None
        if output.logprobs is not None:
            from runtime.sample.logprobs import to_lists

            per_row = [s.sampling_params.logprobs or 0 for s, tokens in zip(states, token_lists) for _ in tokens]
            logprobs = to_lists(output.logprobs, per_row)
        return PendingOutput.done(ModelRunnerOutput([s.req_id for s in states], token_lists, logprobs, prompt_logprobs))

    def _apply_grammar_bitmask(
        self, so: SchedulerOutput, states: list[CachedRequestState], logits: torch.Tensor, logits_row: list[int] | None = None
    ) -> None:
        """Mask the logits rows of the constrained requests to the tokens their grammars allow
        (state ``i``'s row is ``logits_row[i]``, default ``i``)."""
        row_of = so.structured_output_request_ids
        logits_rows, mask_rows = [], []
        for i, state in enumerate(states):
            row = row_of.get(state.req_id)
            if row is not None:
                logits_rows.append(i if logits_row is None else logits_row[i])
                mask_rows.append(row)
        if not logits_rows:
            return
        bitmask = resolve_bitmask(so.grammar_bitmask, slots_ok=self.mask_table is not None)
        if isinstance(bitmask, SlotBitmask):
            slots = bitmask.slots if mask_rows == list(range(len(bitmask.slots))) else bitmask.slots[mask_rows]
            self.apply_token_bitmask(logits, self.mask_table.sync(bitmask), logits_rows, slots=slots)
            return
        if mask_rows != list(range(bitmask.shape[0])):
            # numpy on this thread: torch's indexing splits the copy over its intra-op threads
            bitmask = torch.from_numpy(bitmask.numpy()[mask_rows])
        self.apply_token_bitmask(logits, bitmask, logits_rows)

    def _sampling_metadata(self, states: list[CachedRequestState]):
        from runtime.sample.metadata import build_sampling_metadata, step_generator

        output_token_ids = [self.input_batch.output_token_ids(s) for s in states]
        seeds = [(s.sampling_params.seed, len(output)) if s.sampling_params.seed is not None else None
                 for s, output in zip(states, output_token_ids)]
        generators = [None if key is None else step_generator(*key, self.device) for key in seeds]
        return build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            output_token_ids,
            generators,
            self.model_config.vocab_size,
            self.device,
            seeds=seeds,
        )

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens this step's chunk predicts (position p -> token p + 1)."""
        result: dict[str, LogprobsLists] = {}
        for i, state in enumerate(inputs.states):
            if state.sampling_params.prompt_logprobs is None or inputs.num_known[i] > len(state.prompt_token_ids):
                continue  # none wanted, or no longer computing its prompt (outputs since)
            from runtime.sample.logprobs import compute_prompt_logprobs, to_lists

            start = int(inputs.num_computed[i])
            end = min(start + int(inputs.num_scheduled[i]), len(state.prompt_token_ids) - 1)
            if end <= start:
                result[state.req_id] = LogprobsLists([], [], [])
                continue
            offset = int(inputs.query_start_loc[i])
            targets = upload(state.prompt_token_ids[start + 1 : end + 1], torch.int64, self.device)
            pieces = []
            for lo in range(0, end - start, PROMPT_LOGPROBS_CHUNK):
                hi = min(lo + PROMPT_LOGPROBS_CHUNK, end - start)
                logits = self.model.compute_logits(hidden[offset + lo : offset + hi])
                tensors = compute_prompt_logprobs(logits, targets[lo:hi], state.sampling_params.prompt_logprobs)
                pieces.append(to_lists(tensors, [state.sampling_params.prompt_logprobs] * (hi - lo)))
            result[state.req_id] = LogprobsLists(
                [r for p in pieces for r in p.token_ids], [r for p in pieces for r in p.logprobs], [r for p in pieces for r in p.ranks]
            )
        return result


def _sampling(inputs: StepInputs, sample_rows: np.ndarray) -> tuple[list[CachedRequestState], list[str], np.ndarray]:
    """The states, ids and input batch rows of the step's requests that sample (``sample_rows``)."""
    if len(sample_rows) == len(inputs.states):
        return inputs.states, inputs.req_ids, inputs.rows
    return [inputs.states[i] for i in sample_rows], [inputs.req_ids[i] for i in sample_rows], inputs.rows[sample_rows]
