"""Reading a proposer head's checkpoint: a folder with config.json and its tensors.

Published EAGLE and Medusa heads ship ``*.safetensors`` (EAGLE-3, converted heads) or a
PyTorch pickle (``pytorch_model.bin``, ``medusa_lm_head.pt``); both are read (the pickle with
``weights_only``, so it can hold nothing but tensors).
"""

from __future__ import annotations

import glob
import json
import os

import torch
from torch import nn

from runtime.models.linear import MergedLinear

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def read_head_config(path: str, what: str) -> dict:
    """The folder's config.json as a dict."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{what} checkpoint {path!r} has no config.json (expected a folder with config.json and weights)")
    with open(config_file) as f:
        return json.load(f)


def head_weight_files(path: str, what: str) -> list[str]:
    """The folder's weight files: those of the first pattern that matches any file."""
    for pattern in WEIGHT_PATTERNS:
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    raise ValueError(f"{what} checkpoint {path!r} has no weights ({', '.join(WEIGHT_PATTERNS)})")


def read_head_shapes(path: str, what: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, without reading the weights (a factory checks a head with it
    before any worker starts)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in head_weight_files(path, what):
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
        else:
            tensors = torch.load(file, map_location="meta", weights_only=True)
            shapes.update((name, tuple(t.shape)) for name, t in tensors.items())
    return shapes


def checkpoint_shapes(module: nn.Module, stacked: dict[str, tuple[str, str]]) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint holds for ``module`` (built whole, e.g. on the meta device), under the
    checkpoint's names: a fused projection's parameter as its parts (``q_proj``, ``k_proj``, ``v_proj``),
    as ``stacked`` maps them for the loader."""
    parts: dict[str, list[tuple[str, str]]] = {}
    for checkpoint_name, (fused_name, shard) in stacked.items():
        parts.setdefault(fused_name, []).append((checkpoint_name, shard))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in module.named_parameters():
        module_path, _, param_name = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        layer = module.get_submodule(module_path)
        if module_name not in parts or not isinstance(layer, MergedLinear):
            shapes[name] = tuple(param.shape)
            continue
        for checkpoint_name, shard in parts[module_name]:
            rows = layer.shard_offsets[shard][1] * layer.tp_size // layer.replicas[shard]  # the whole projection
            shapes[".".join(filter(None, (parent, checkpoint_name, param_name)))] = (rows, *param.shape[1:])
    return shapes


def check_head_tensors(what: str, path: str, expected: dict[str, tuple[int, ...] | None],
                       found: dict[str, tuple[int, ...]], optional: dict[str, tuple[int, ...] | None]) -> None:
    """Refuse a checkpoint that lacks a tensor of ``expected``, holds one that neither ``expected`` nor
    ``optional`` names, or holds one of another shape (a shape None: any); the message names the tensors
    as the checkpoint does."""
    allowed = {**optional, **expected}
    wrong = sorted(n for n, shape in allowed.items() if n in found and shape is not None and found[n] != shape)
    problems = []
    for label, names in (("missing tensors", sorted(set(expected) - set(found))),
                         ("unexpected tensors", sorted(set(found) - set(allowed))),
                         ("tensors of the wrong shape", [f"{n} {list(found[n])} (expected {list(allowed[n])})"
                                                         for n in wrong])):
        if names:
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            problems.append(f"{label} {', '.join(names[:4])}{more}")
    if problems:
        raise ValueError(f"{what} {path!r} does not match its config.json: {'; '.join(problems)}")


def read_head_tensors(path: str, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files (the first pattern that matches any file)."""
    files = head_weight_files(path, what)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors.update(load_file(file))
        else:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def hf_config(config: dict):
    """A transformers config object of the head's config.json (llama-shaped heads)."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}
    return LlamaConfig(**fields)
