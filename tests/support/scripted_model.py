"""A tiny llama whose greedy reply to any chat prompt is a fixed list of tokens (helpers for server tests).

Its attention and MLP outputs are zero, so each position's hidden state is its own token's embedding;
the embeddings of the script's tokens are distinct unit vectors and the LM head maps each one to the
next token of the script (the generation prompt's last token to the first, the last to EOS) with a logit
80 above every other token's. The output is fixed by the weights alone: no sampling parameter forces it.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

STEP_LOGIT = 10.0  # times 8, the RMS norm's gain on a unit vector in 64 dimensions


def script_token_ids(tokenizer, script: list[str]) -> list[int]:
    """The id of each text of ``script``, each a single token of ``tokenizer``."""
    ids = []
    for text in script:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert len(encoded) == 1, f"{text!r} is {len(encoded)} tokens, not one"
        ids.append(encoded[0])
    return ids


def build_scripted_model(source: str, path, script: list[str], added_tokens: list[str] = ()) -> str:
    """A copy of the tiny llama at ``source`` in ``path`` that replies ``script`` then EOS to any chat prompt;
    ``added_tokens`` are added to its tokenizer (as Qwen3's ``<think>`` is: not special) before reading ``script``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = str(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(list(added_tokens))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    chain = [prompt[-1], *script_token_ids(tokenizer, script), tokenizer.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, "each token of the script (and the prompt's last) must differ"
    weights = load_file(os.path.join(source, "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    vocab, hidden = len(tokenizer), embed.shape[1]
    assert len(chain) - 1 <= hidden
    embed = torch.cat([embed, torch.zeros(vocab - embed.shape[0], hidden)])
    head = torch.zeros(vocab, hidden)
    for step, (current, following) in enumerate(zip(chain, chain[1:])):
        embed[current] = torch.nn.functional.one_hot(torch.tensor(step), hidden).float()
        head[following, step] = STEP_LOGIT
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["vocab_size"] = vocab
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if os.path.exists(os.path.join(source, "generation_config.json")):
        shutil.copy(os.path.join(source, "generation_config.json"), path)
    tokenizer.save_pretrained(path)
    return path
