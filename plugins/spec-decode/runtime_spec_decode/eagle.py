"""The ``eagle`` and ``eagle3`` proposers: EAGLE heads fed the target's hidden states.

Both are :class:`runtime.spec_decode.DraftModule` s with KV of their own; at position ``p``
they read token ``p + 1`` and the target's hidden state of position ``p`` (later passes:
their own carried hidden state), as the published heads were trained.

* EAGLE-1 (Li et al. 2024; SafeAILab/EAGLE checkpoints): ``fc`` [H, 2H] (bias optional) on
  ``concat(embed(token), hidden)``, then Llama decoder layers ``layers.N`` whose first has no
  input norm, and no final norm; the target's LM head gives the logits, the target's final
  (normed) hidden state is the input. ``embed_tokens`` is the target's unless the checkpoint
  has its own.
* EAGLE-3 (Li et al. 2025): the input is the residual stream entering three target layers
  (``eagle_config.eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)``),
  concatenated and projected by ``fc`` [H, 3H]; one ``midlayer`` whose attention reads
  ``concat(input_layernorm(embed), hidden_norm(hidden))`` [2H]; a final ``norm`` and its own
  ``lm_head`` over ``draft_vocab_size`` tokens, mapped to target ids by ``d2t``
  (target id = draft id + d2t[draft id]). Its pre-norm hidden state is carried.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from runtime.distributed import tp_size
from runtime.models.layers import MLP, Attention, Linear, RMSNorm
from runtime.models.linear import MergedLinear
from runtime.models.llama import STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer, head_dim
from runtime.models.rotary import RotaryEmbedding, rope_parameters
from runtime.models.weights import IGNORED_SUFFIXES, KV_SCALE_SUFFIXES, load_hf_weights
from runtime.spec_decode import DraftProposals, ProposalBatch, TargetInfo
from runtime_spec_decode.checkpoint import (
    check_head_tensors,
    checkpoint_shapes,
    hf_config,
    read_head_config,
    read_head_shapes,
    read_head_tensors,
)
from runtime_spec_decode.draft_model import check_draft_split, check_target_hidden_size
from runtime_spec_decode.options import require_model


class SkipNorm(nn.Module):
    """EAGLE-1's first layer has no input norm: ``x`` (or ``x + residual`` twice, as a norm's pair)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


class EagleHead(nn.Module):
    """Shared parts: embeddings (own or the target's), rotary embedding, logits."""

    input_shift = 1

    def __init__(self, config, target: TargetInfo, has_embeddings: bool, max_positions: int = 0):
        """``max_positions``: the positions the head will see (the target's max_model_len); its rotary table
        covers them even past its config's max_position_embeddings (EAGLE's own code extends it too)."""
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if has_embeddings else None
        self._target = [target.model]  # not a submodule: its weights are the target's
        self.rotary_emb = RotaryEmbedding(head_dim(config), rope_parameters(config),
                                          max(config.max_position_embeddings, max_positions))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)


class Eagle1Module(EagleHead):
    target_hidden = "last"

    def __init__(self, config, target: TargetInfo, has_embeddings: bool, fc_bias: bool, max_positions: int = 0):
        super().__init__(config, target, has_embeddings, max_positions)
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = SkipNorm()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None):
        hidden = self.fc(torch.cat([self.embed(input_ids), hidden_states.to(self.fc.weight.dtype)], dim=-1))
        rotation = self.rotary_emb.rotation(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotation)
        hidden = hidden + residual
        return hidden, hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def attention_specs(self) -> list:
        return [layer.self_attn.attn.spec for layer in self.layers]


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over ``[norm(embeds), norm(hidden)]`` (2H wide)."""

    def __init__(self, config):
        super().__init__()
        size = config.hidden_size
        self.input_layernorm = RMSNorm(size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, 0)
        q, kv = (n * self.self_attn.head_size for n in (config.num_attention_heads, config.num_key_value_heads))
        # Whole sizes (each rank keeps its part), as the attention's own qkv_proj over H.
        self.self_attn.qkv_proj = MergedLinear(2 * size, {"q": q, "k": kv, "v": kv}, False,
                                               replicas=self.self_attn.qkv_proj.replicas)
        self.mlp = MLP(size, config.intermediate_size, config.hidden_act, False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotation) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, rotation)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Module(EagleHead):
    def __init__(self, config, target: TargetInfo, has_embeddings: bool, target_layers: tuple[int, ...],
                 max_positions: int = 0):
        super().__init__(config, target, has_embeddings, max_positions)
        self.target_hidden = target_layers
        target_size = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = Linear(len(target_layers) * target_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = Linear(config.hidden_size, self.draft_vocab_size, bias=False)
        self.target_vocab_size = target.vocab_size
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None):
        hidden = hidden_states.to(self.fc.weight.dtype)
        if hidden.shape[-1] != self.hidden_size:  # the target's layers, first pass: project them
            hidden = self.fc(hidden)
        rotation = self.rotary_emb.rotation(positions, hidden.dtype)
        x, residual = self.midlayer(self.embed(input_ids), hidden, rotation)
        normed, carried = self.norm(x, residual)
        return normed, carried

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(hidden).float()  # [N, draft_vocab]
        if self.draft_vocab_size == self.target_vocab_size and not self.d2t.any():
            return draft
        logits = draft.new_full((hidden.shape[0], self.target_vocab_size), float("-inf"))
        logits[:, torch.arange(self.draft_vocab_size, device=hidden.device) + self.d2t] = draft
        return logits

    def attention_specs(self) -> list:
        return [self.midlayer.self_attn.attn.spec]


def target_text_config(hf_config):
    """The text part of the target's config (a multimodal config nests it)."""
    get_text_config = getattr(hf_config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else hf_config


def default_eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


class EagleProposer:
    """``eagle`` (EAGLE-1, or EAGLE-3 when the checkpoint has a ``midlayer``) and ``eagle3``."""

    uses_kv_cache = True
    needs_hidden_states = True

    def __init__(self, path: str, method: str, target_vocab_size: int, tensor_parallel_size: int = 1,
                 target_hf_config: Any = None, max_model_len: int = 0):
        """Checks the head against the target from its config.json and its tensors' names (no weights are
        read), so a head that does not fit is refused before any worker starts."""
        self.path, self.method, self.max_model_len = path, method, max_model_len
        self.config = read_head_config(path, method)
        vocab = self.config.get("vocab_size")
        if vocab != target_vocab_size:
            raise ValueError(f"{method} head {path!r} has vocab_size {vocab}, the target model {target_vocab_size}: "
                             "the head must be trained for the target (same tokenizer and vocabulary)")
        head_config = hf_config(self.config)
        check_draft_split(f"{method} head", path, head_config, tensor_parallel_size)
        shapes = read_head_shapes(path, method)
        self.is_eagle3 = any(name.startswith("midlayer.") for name in shapes)
        if method == "eagle3" and not self.is_eagle3:
            raise ValueError(f"eagle3 head {path!r} has no 'midlayer.*' tensors (an EAGLE-1 head? use method 'eagle')")
        # EAGLE-1 concatenates the target's hidden state with its own embeddings; EAGLE-3 projects the
        # target's (``target_hidden_size`` wide when it differs from its own).
        head_size = (getattr(head_config, "target_hidden_size", None) if self.is_eagle3 else None) or head_config.hidden_size
        check_target_hidden_size(f"{method} head", path, head_size, target_hf_config)
        self.target_layers = None
        if self.is_eagle3 and target_hf_config is not None:
            self.target_layers = self.eagle3_layers(target_text_config(target_hf_config).num_hidden_layers)
        self.check_fc(shapes.get("fc.weight"), head_config.hidden_size, head_size)
        self.check_tensors(shapes, head_config, target_vocab_size)

    def check_fc(self, shape, hidden_size: int, head_size: int) -> None:
        """``fc`` maps what the head reads of the target to its own width: [H, 2H] (EAGLE-1: embeddings and the
        hidden state), [H, layers x target size] (EAGLE-3); one of other sizes would fail in every worker."""
        if self.is_eagle3:
            if self.target_layers is None:
                return
            inputs, reads = len(self.target_layers) * head_size, f"{len(self.target_layers)} target layers of size {head_size}"
        else:
            inputs, reads = 2 * hidden_size, f"its embeddings and the target's hidden state, {hidden_size} each"
        if shape is None or tuple(shape) != (hidden_size, inputs):
            found = "no fc.weight" if shape is None else f"fc.weight of shape {list(shape)}"
            raise ValueError(f"{self.method} head {self.path!r} has {found}, but its config.json makes it "
                             f"[{hidden_size}, {inputs}] (it reads {reads})")

    def check_tensors(self, shapes: dict[str, tuple[int, ...]], head_config, target_vocab_size: int) -> None:
        """The checkpoint holds every tensor :meth:`load` asks for, of its shape, and none it would refuse:
        compared with the head built on the meta device, as the loader names and stacks them."""
        if tp_size() != 1:
            return  # a worker of TP > 1 (its layers hold parts): the engine core checked the whole head
        target = SimpleNamespace(model=None, vocab_size=target_vocab_size)
        has_embeddings = "embed_tokens.weight" in shapes
        with torch.device("meta"):
            if self.is_eagle3:
                module = Eagle3Module(head_config, target, has_embeddings, self.target_layers or (0, 0, 0))
            else:
                module = Eagle1Module(head_config, target, has_embeddings, "fc.bias" in shapes)
        expected = checkpoint_shapes(module, STACKED_PARAMS)
        optional = {}
        if self.is_eagle3:
            if self.target_layers is None:  # fc's width depends on the target's layers: unknown here
                expected["fc.weight"] = None
            optional = {"d2t": (module.draft_vocab_size,), "t2d": None}  # load() reads d2t, drops t2d
        attention = {name for name, m in module.named_modules() if isinstance(m, Attention) or hasattr(m, "attn")}
        found = {name: shape for name, shape in shapes.items() if not name.endswith(IGNORED_SUFFIXES)  # the loader
                 and not any(name.endswith(s) and name[: -len(s)] in attention for s in KV_SCALE_SUFFIXES)}
        check_head_tensors(f"{self.method} head", self.path, expected, found, optional)

    def eagle3_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs an EAGLE-3 head reads: its config's, else the default; checked."""
        layers = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(layers or default_eagle3_layers(num_target_layers))
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"{self.method} head {self.path!r} reads target layer {bad[0]} "
                             f"(eagle_aux_hidden_state_layer_ids), but the target model has {num_target_layers} layers")
        return layers

    @classmethod
    def from_config(cls, config: Any, method: str) -> EagleProposer:
        model_config = config.model_config
        target_hf_config = getattr(getattr(model_config, "resolved", None), "hf_config", None)
        return cls(require_model(config, method), method, model_config.vocab_size,
                   config.parallel_config.tensor_parallel_size, target_hf_config, model_config.max_model_len)

    def load(self, target: TargetInfo) -> EagleHead:
        tensors = read_head_tensors(self.path, self.method)
        is_eagle3 = self.is_eagle3  # the factory read the checkpoint's names and checked its sizes
        config = hf_config(self.config)
        has_embeddings = "embed_tokens.weight" in tensors
        if is_eagle3:
            layers = self.target_layers or self.eagle3_layers(target_text_config(target.hf_config).num_hidden_layers)
            module = Eagle3Module(config, target, has_embeddings, layers, self.max_model_len)
            d2t = tensors.pop("d2t", None)
            tensors.pop("t2d", None)
        else:
            module = Eagle1Module(config, target, has_embeddings, "fc.bias" in tensors, self.max_model_len)
            d2t = None
        module = module.to(dtype=target.dtype)
        with torch.no_grad():
            loaded = load_hf_weights(module, tensors.items(), STACKED_PARAMS, False)
            if d2t is not None:
                module.d2t.copy_(d2t)
        missing = sorted(set(name for name, _ in module.named_parameters()) - loaded)
        if missing:
            raise ValueError(f"{self.method} head {self.path!r} lacks tensors for {', '.join(missing[:5])}")
        return module.to(device=target.device).eval().requires_grad_(False)

    def propose(self, batch: ProposalBatch) -> DraftProposals:
        raise RuntimeError("EAGLE runs in the worker: the model runner drives its DraftModule")
