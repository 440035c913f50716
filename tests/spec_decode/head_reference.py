"""Independent references of draft-model, EAGLE-1, EAGLE-3 and Medusa greedy drafts.

Built from the checkpoints that ``heads.py`` writes, with transformers' Llama modules and plain
torch only (none of runtime's code): the target's hidden states come from transformers with
``output_hidden_states``, and every draft recomputes the head over the whole sequence (no KV
cache). For a context of ``L`` tokens ``t[0..L-1]`` (the newest, ``t[L-1]``, not yet verified):

* EAGLE reads, at position ``p``, token ``t[p + 1]`` and the target's hidden state of ``p``
  (``p < L - 1``); the first draft comes from position ``L - 2``, each later one from the
  position after, which reads the previous draft and the head's own output there.
* Medusa head ``i`` maps the target's final hidden state of position ``L - 2`` (the one
  ``t[L-1]`` was sampled from) to draft ``i``.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn


def head_files(path: str, filename: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, the tensors of ``filename``) of a head folder."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    file = os.path.join(path, filename)
    if filename.endswith(".safetensors"):
        from safetensors.torch import load_file

        return config, load_file(file)
    return config, torch.load(file, weights_only=True)


def llama_config(config: dict):
    from transformers import LlamaConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "eagle_config")}
    result = LlamaConfig(**fields)
    result._attn_implementation = "eager"
    return result


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n]


def load(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    state = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    module.load_state_dict(state, strict=True)


class Target:
    """The target model in transformers: hidden states per layer, embeddings, LM head."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def hidden_states(self, tokens: list[int]) -> tuple[torch.Tensor, ...]:
        """[T, H] per entry: entry ``i`` enters decoder layer ``i``; the last is the final normed one."""
        out = self.model(torch.tensor([tokens]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor(tokens))


class Eagle1Reference:
    """fc on [embed, hidden], Llama decoder layers (the first without input norm), no final
    norm, the target's LM head."""

    def __init__(self, target: Target, path: str):
        from transformers.models.llama.modeling_llama import LlamaModel

        config, tensors = head_files(path, "pytorch_model.bin")
        self.target = target
        size = config["hidden_size"]
        self.fc = nn.Linear(2 * size, size, bias=True)
        load(self.fc, tensors, "fc.")
        self.body = LlamaModel(llama_config(config)).eval()
        self.body.layers[0].input_layernorm = nn.Identity()
        self.body.norm = nn.Identity()
        load(self.body.layers, tensors, "layers.")

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        hidden = self.target.hidden_states(tokens)[-1][:-1]  # positions 0 .. L - 2
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            x = self.fc(torch.cat([self.target.embed(ids), hidden], dim=-1))
            out = self.body(inputs_embeds=x[None], position_ids=torch.arange(len(ids))[None]).last_hidden_state[0]
            drafts.append(int(self.target.model.lm_head(out[-1]).argmax()))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts


class Eagle3Midlayer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(embed), hidden_norm(hidden)]."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = (
            LlamaRMSNorm(size, eps) for _ in range(3))
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            out_size = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * size, out_size, bias=False))
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotation) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, _ = self.self_attn(x[None], position_embeddings=rotation, attention_mask=causal_mask(x.shape[0]))
        hidden = hidden + attn[0]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Reference:
    """fc over the concatenated target layer inputs, one midlayer, a final norm and an own
    LM head over the draft vocabulary, whose ids map to the target's by ``d2t``."""

    def __init__(self, target: Target, path: str):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        config, tensors = head_files(path, "model.safetensors")
        self.target = target
        self.layers = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        hf = llama_config(config)
        size = hf.hidden_size
        self.fc = nn.Linear(len(self.layers) * size, size, bias=False)
        self.midlayer = Eagle3Midlayer(hf).eval()
        self.norm = LlamaRMSNorm(size, hf.rms_norm_eps)
        self.lm_head = nn.Linear(size, config["draft_vocab_size"], bias=False)
        self.rotary = LlamaRotaryEmbedding(hf)
        for name in ("fc", "midlayer", "norm", "lm_head"):
            load(getattr(self, name), tensors, f"{name}.")
        self.d2t = tensors["d2t"]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        states = self.target.hidden_states(tokens)
        hidden = self.fc(torch.cat([states[i] for i in self.layers], dim=-1))[:-1]  # positions 0 .. L - 2
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            positions = torch.arange(len(ids))[None]
            rotation = self.rotary(hidden[None], positions)
            out = self.midlayer(self.target.embed(ids), hidden, rotation)
            draft_id = int(self.lm_head(self.norm(out[-1])).argmax())
            drafts.append(draft_id + int(self.d2t[draft_id]))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])  # the pre-norm output is carried
        return drafts


class MedusaReference:
    """Head ``i``: residual blocks ``x + SiLU(linear(x))`` then its own LM head, on the target's
    final hidden state."""

    def __init__(self, target: Target, path: str):
        config, tensors = head_files(path, "medusa_lm_head.safetensors")
        self.target = target
        num_layers = config["medusa_num_layers"]
        self.heads = []
        for i in range(config["medusa_num_heads"]):
            blocks = [(tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"]) for j in range(num_layers)]
            self.heads.append((blocks, tensors[f"{i}.{num_layers}.weight"]))

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        h = self.target.hidden_states(tokens)[-1][-2]  # where t[L-1] was sampled from
        drafts = []
        for blocks, lm_head in self.heads[:k]:
            x = h
            for weight, bias in blocks:
                x = x + nn.functional.silu(x @ weight.T + bias)
            drafts.append(int((x @ lm_head.T).argmax()))
        return drafts


class DraftModelReference:
    """A draft model: its own greedy continuation of the context."""

    def __init__(self, target: Target, path: str):
        self.draft = Target(path)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        tokens = list(tokens)
        for _ in range(k):
            tokens.append(int(self.draft.model(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[-k:]


REFERENCES = {"draft_model": DraftModelReference, "eagle": Eagle1Reference, "eagle3": Eagle3Reference, "medusa": MedusaReference}
