"""The ``draft_model`` proposer: a second, smaller model with the target's tokenizer.

Runs in the worker (``uses_kv_cache``): the engine gives it a paged KV cache of its own over
the target's block ids and drives it (``runtime.worker.spec_decode_runner``): a catch-up pass
over the tokens the target computes, then k autoregressive passes per step. Greedy requests
draft the argmax, random ones sample from the draft's distribution, whose probabilities the
rejection sampler uses as q.

A Hugging Face draft whose config.json has a ``quantization_config`` is loaded through its own
quant method, chosen and configured from that config as the target's is from its own (the
engine's ``--quantization`` is the target's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from runtime.spec_decode import DraftProposals, ProposalBatch, TargetInfo
from runtime_spec_decode.options import require_model


def resolve_draft(path: str, target_vocab_size: int, what: str = "draft model"):
    """Resolve the checkpoint at ``path`` and refuse one whose vocabulary is not the target's."""
    from runtime.model_loader.resolve import resolve_model

    resolved = resolve_model(path)
    vocab = getattr(resolved.hf_config, "vocab_size", None)
    if vocab != target_vocab_size:
        raise ValueError(
            f"{what} {path!r} has vocab_size {vocab}, the target model {target_vocab_size}: a {what} must share the "
            "target's tokenizer and vocabulary (e.g. a smaller model of the same family)"
        )
    return resolved


def check_draft_split(what: str, path: str, hf_config, tensor_parallel_size: int) -> None:
    """Refuse a draft (or head) whose heads or MLP the ranks cannot split, naming its sizes and the valid ones."""
    from runtime.distributed.layout import check_parallel_layout

    try:
        check_parallel_layout(hf_config, tensor_parallel_size, 1)
    except ValueError as exc:
        raise ValueError(f"{what} {path!r} cannot run under tensor parallelism as configured: {exc}") from None


def model_positions(hf_config) -> int | None:
    """The most positions a checkpoint was built for (its config's length field), or None if it names none."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return None


def draft_positions(spec: dict) -> int | None:
    """The most positions the draft model of a speculative_config holds (the engine lowers a default
    max_model_len to it); None when it names none or cannot be read (the factory then says why)."""
    from runtime.model_loader.resolve import resolve_model

    path = spec.get("model")
    if not isinstance(path, str) or not path:
        return None
    try:
        return model_positions(resolve_model(path).hf_config)
    except (ValueError, OSError):
        return None


def check_draft_length(what: str, path: str, hf_config, max_model_len: int) -> None:
    """Refuse a draft that holds fewer positions than the target's max_model_len: a long request would
    run it past its last position (garbage drafts, or an out-of-range read of its position tables)."""
    positions = model_positions(hf_config)
    if positions is not None and positions < max_model_len:
        raise ValueError(
            f"{what} {path!r} supports at most {positions} positions (max_position_embeddings), but the target's "
            f"max_model_len is {max_model_len}: lower max_model_len (--max-model-len) to {positions} or less, or use a "
            f"{what} with a longer context"
        )


def check_target_hidden_size(what: str, path: str, hidden_size: int, target_hf_config) -> None:
    """Refuse a head that reads target hidden states of another width than the target's."""
    get_text_config = getattr(target_hf_config, "get_text_config", None)
    text_config = get_text_config() if callable(get_text_config) else target_hf_config
    target_size = getattr(text_config, "hidden_size", None)
    if target_size is not None and hidden_size != target_size:
        raise ValueError(
            f"{what} {path!r} reads target hidden states of size {hidden_size}, but the target model's hidden_size is "
            f"{target_size}: the head must be trained for this target"
        )


class DraftModelModule(nn.Module):
    """A causal LM as a :class:`runtime.spec_decode.DraftModule` (reads no target hidden states)."""

    target_hidden = None
    input_shift = 0

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None):
        return self.model(input_ids, positions), None  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def attention_specs(self) -> list:
        return self.model.attention_specs()


class DraftModelProposer:
    """Implements :class:`runtime.spec_decode.WorkerProposer` with a :class:`DraftModelModule`."""

    uses_kv_cache = True
    needs_hidden_states = False

    def __init__(self, path: str, model_config: Any, tensor_parallel_size: int = 1):
        """``model_config``: the target's :class:`runtime.config.ModelConfig` (the draft's own is derived from it)."""
        from runtime.quantization import select_quant_method, supports_tensor_parallel

        self.path = path
        self.resolved = resolve_draft(path, model_config.vocab_size)
        check_draft_split("draft model", path, self.resolved.hf_config, tensor_parallel_size)
        quantization = select_quant_method(None, self.resolved.hf_config)  # the checkpoint's own, if any
        if quantization is not None and tensor_parallel_size > 1 and not supports_tensor_parallel(quantization):
            raise ValueError(
                f"draft model {path!r} is quantized ({quantization!r}) and tensor_parallel_size is {tensor_parallel_size}: "
                "its quantized linear layers are not split across ranks; use another draft or tensor_parallel_size 1"
            )
        check_draft_length("draft model", path, self.resolved.hf_config, model_config.max_model_len)
        self.model_config = dataclasses.replace(
            model_config, model=path, quantization=quantization, resolved=self.resolved,
            architecture=self.resolved.architecture, gguf_file=self.resolved.gguf_file,
        )

    @classmethod
    def from_config(cls, config: Any) -> DraftModelProposer:
        return cls(require_model(config, "draft_model"), config.model_config, config.parallel_config.tensor_parallel_size)

    def load(self, target: TargetInfo) -> DraftModelModule:
        from runtime.model_loader.loader import load_model
        from runtime.quantization import build_quant_config

        self.resolved.quant_config = build_quant_config(self.model_config, target.platform)
        model = load_model(self.resolved, load_format=target.load_format, dtype=target.dtype, device=target.device,
                           seed=target.seed + 1)
        return DraftModelModule(model)

    def propose(self, batch: ProposalBatch) -> DraftProposals:
        raise RuntimeError("the draft_model proposer runs in the worker: the model runner drives its DraftModule")
