"""Stream tensors out of a Hugging Face folder's safetensors files.

Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) can run code when loaded, so they are
refused rather than read.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")


def safetensors_files(folder: str) -> list[str]:
    """The weight files of ``folder``: those of the index file when present, else all ``*.safetensors``."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        return _indexed_files(folder, index)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    pickles = sorted(
        os.path.basename(p) for pattern in PICKLE_PATTERNS for p in glob.glob(os.path.join(folder, pattern))
    )
    if pickles:
        raise ValueError(
            f"{folder!r} holds only pickle checkpoints ({', '.join(pickles)}); they are refused because loading "
            "them can run arbitrary code. Convert them to safetensors (e.g. load with transformers and "
            "save_pretrained(safe_serialization=True)), or use a .gguf file"
        )
    raise ValueError(
        f"no weights found in {folder!r}: expected *.safetensors files (or use load_format='dummy' for random weights)"
    )


def _indexed_files(folder: str, index: str) -> list[str]:
    """The files an index's ``weight_map`` names; a ValueError naming the index when it is broken
    or names a file the folder lacks."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index!r} is not a safetensors index (a JSON object with a \"weight_map\" of tensor "
                         f"name -> file name): {type(exc).__name__}: {exc}") from None
    missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ValueError(f"{index!r} names weight files that {folder!r} lacks: {', '.join(missing)}")
    return [os.path.join(folder, name) for name in names]


SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def safetensors_float_dtype(folder: str) -> torch.dtype | None:
    """The floating dtype most of the first weight file's tensors have, from its header alone;
    None without safetensors files or floating tensors."""
    from safetensors import safe_open

    try:
        first = safetensors_files(folder)[0]
    except ValueError:
        return None
    counts: dict[torch.dtype, int] = {}
    with safe_open(first, framework="pt") as f:
        for name in f.keys():
            dtype = SAFETENSORS_FLOAT_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


def safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the folder, with a progress bar."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading safetensors", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)
