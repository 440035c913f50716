"""The ``medusa`` proposer: Medusa heads on the target's last hidden state (Cai et al. 2024).

Head ``i`` (0-based) maps the target's final (normed) hidden state ``h`` of the position the
newest token was sampled from to the token ``i + 1`` places after that token: ``num_layers``
residual blocks ``x + SiLU(linear(x))`` then its own LM head. The drafts are each head's
argmax (q = 1), so the heads need no KV cache; the engine hands them the hidden states.

Checkpoint layouts read (a folder with config.json and the tensors):

* FasterDecoding/Medusa: ``{i}.{j}.linear.weight/bias`` for block ``j`` and ``{i}.{L}.weight``
  for the head (``medusa_lm_head.safetensors`` or ``.pt``), config ``medusa_num_heads``,
  ``medusa_num_layers`` (optionally prefixed ``medusa_head.``);
* vLLM's converted heads: ``blocks.{i}.layers.{j}.linear.weight/bias`` and
  ``lm_heads.{i}.weight``, config ``num_heads``, ``num_hidden_layers``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from runtime.spec_decode import DraftProposals, ProposalBatch, TargetInfo
from runtime_spec_decode.checkpoint import read_head_config, read_head_shapes, read_head_tensors
from runtime_spec_decode.draft_model import check_target_hidden_size
from runtime_spec_decode.options import require_model, speculative_options

ORIGINAL_NAME = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(.+)$")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(hidden)


def original_name(name: str, num_layers: int) -> str:
    """FasterDecoding's name of one of this module's tensor names (for messages)."""
    parts = name.split(".")
    if parts[0] == "lm_heads":
        return f"{parts[1]}.{num_layers}.{parts[2]}"
    if parts[0] == "blocks":
        return f"{parts[1]}.{parts[3]}.{'.'.join(parts[4:])}"
    return name


def vllm_names(tensors: dict, num_layers: int) -> dict:
    """Tensors under this module's names (``blocks.{i}.layers.{j}.linear.*``, ``lm_heads.{i}.weight``)."""
    renamed = {}
    for name, tensor in tensors.items():
        match = ORIGINAL_NAME.match(name)
        if match is not None:
            head, index, rest = int(match[1]), int(match[2]), match[3]
            name = f"lm_heads.{head}.{rest}" if index == num_layers else f"blocks.{head}.layers.{index}.{rest}"
        renamed[name] = tensor
    return renamed


class MedusaProposer:
    """Implements :class:`runtime.spec_decode.WorkerProposer` without KV (``propose`` from hidden states)."""

    uses_kv_cache = False
    needs_hidden_states = True

    def __init__(self, path: str, target_vocab_size: int, target_hf_config: Any = None,
                 num_speculative_tokens: int | None = None):
        """Checks the head against the target from its config.json and its tensors' shapes (cheap: no
        weights are read), so a bad head is refused before any worker starts."""
        self.path = path
        config = read_head_config(path, "medusa")
        self.num_heads = int(config.get("medusa_num_heads", config.get("num_heads", 0)))
        self.num_layers = int(config.get("medusa_num_layers", config.get("num_hidden_layers", 1)))
        if self.num_heads < 1:
            raise ValueError(f"medusa head {path!r}: config.json names no heads (medusa_num_heads or num_heads)")
        if num_speculative_tokens is not None and num_speculative_tokens > self.num_heads:
            # Head i drafts the i-th token; more drafts than heads would only be padding the target verifies.
            raise ValueError(f"num_speculative_tokens is {num_speculative_tokens}, but medusa head {path!r} has "
                             f"{self.num_heads} heads (one draft each): valid values are 1..{self.num_heads}")
        self.target_vocab_size = target_vocab_size
        raw = read_head_shapes(path, "medusa")
        shapes = vllm_names(raw, self.num_layers)
        head_shape = shapes.get("lm_heads.0.weight")
        if head_shape is None or len(head_shape) != 2:
            raise ValueError(f"medusa head {path!r} has no LM head of its first head ('0.{self.num_layers}.weight' or "
                             "'lm_heads.0.weight', [vocab_size, hidden_size])")
        vocab, self.hidden_size = head_shape
        if vocab != target_vocab_size:
            raise ValueError(f"medusa head {path!r} predicts {vocab} tokens, the target model has {target_vocab_size}: "
                             "the heads must be trained for the target (same vocabulary)")
        check_target_hidden_size("medusa head", path, self.hidden_size, target_hf_config)
        self.check_layout(shapes, vocab, any(ORIGINAL_NAME.match(name) for name in raw))
        self.heads: nn.ModuleList | None = None

    def check_layout(self, shapes: dict[str, tuple[int, ...]], vocab: int, original: bool) -> None:
        """Every head has ``num_layers`` residual blocks and an LM head of the first head's sizes, nothing else
        (named in messages as the checkpoint names them: FasterDecoding's names when ``original``)."""
        size = self.hidden_size
        expected = {f"lm_heads.{i}.weight": (vocab, size) for i in range(self.num_heads)}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                expected[f"blocks.{i}.layers.{j}.linear.weight"] = (size, size)
                expected[f"blocks.{i}.layers.{j}.linear.bias"] = (size,)
        ours = {n for n in shapes if n.startswith(("blocks.", "lm_heads."))}  # load() ignores other tensors
        problems = []
        for label, names in (("missing", sorted(set(expected) - ours)),
                             ("unexpected", sorted(ours - set(expected))),
                             ("of the wrong shape", sorted(n for n in expected if n in shapes and shapes[n] != expected[n]))):
            if names:
                shown = ", ".join(original_name(n, self.num_layers) if original else n for n in names[:4])
                problems.append(f"{label} tensors {shown}" + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
        if problems:
            raise ValueError(
                f"medusa head {self.path!r} does not match its config.json ({self.num_heads} heads of {self.num_layers} "
                f"residual blocks): {'; '.join(problems)}"
            )

    @classmethod
    def from_config(cls, config: Any) -> MedusaProposer:
        model_config = config.model_config
        target_hf_config = getattr(getattr(model_config, "resolved", None), "hf_config", None)
        return cls(require_model(config, "medusa"), model_config.vocab_size, target_hf_config,
                   speculative_options(config).get("num_speculative_tokens"))

    def load(self, target: TargetInfo) -> None:
        tensors = vllm_names(read_head_tensors(self.path, "medusa"), self.num_layers)
        vocab = tensors["lm_heads.0.weight"].shape[0]  # the factory checked the layout
        blocks = nn.ModuleList(MedusaHead(self.hidden_size, vocab, self.num_layers) for _ in range(self.num_heads))
        state = {}
        for name, tensor in tensors.items():
            parts = name.split(".")
            if parts[0] == "lm_heads":
                state[f"{parts[1]}.lm_head.{parts[2]}"] = tensor
            elif parts[0] == "blocks":
                state[f"{parts[1]}.layers.{'.'.join(parts[3:])}"] = tensor
        blocks.load_state_dict(state, strict=True)
        self.heads = blocks.to(dtype=target.dtype, device=target.device).eval().requires_grad_(False)
        return None

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> DraftProposals:
        k = min(batch.num_speculative_tokens, self.num_heads)
        hidden = batch.hidden_states.to(self.heads[0].lm_head.weight.dtype)  # [R, H]
        drafts = torch.stack([self.heads[i](hidden).argmax(dim=-1) for i in range(k)], dim=1)  # [R, k]
        return DraftProposals(token_ids=drafts.tolist())
