"""Stream dequantized tensors out of a GGUF file, under Hugging Face parameter names.

transformers' GGUF utilities do the hard parts: the llama.cpp -> Hugging Face name map
(``get_gguf_hf_weights_map``) and per-architecture fix-ups (``TENSOR_PROCESSORS``:
un-permuting Llama q/k, Gemma's ``norm - 1``). Unlike ``load_gguf_checkpoint`` this
yields one tensor at a time (no full float32 copy of the model in memory) and skips
re-parsing the vocabulary, which the config already cost once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm


def gguf_weights(gguf_file: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, float tensor)`` for each tensor of ``gguf_file``."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(gguf_file)
    gguf_arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())
    name_map = get_gguf_hf_weights_map(_hf_skeleton(hf_config), processor)
    for tensor in tqdm(reader.tensors, desc="Loading GGUF tensors", unit="tensor"):
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}
        )
        if result.name not in name_map:  # e.g. llama.cpp's precomputed rope_freqs
            continue
        yield name_map[result.name], torch.from_numpy(np.ascontiguousarray(result.weights).copy())


def _hf_skeleton(hf_config) -> torch.nn.Module:
    """The transformers model on the meta device: only its parameter names are used."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
