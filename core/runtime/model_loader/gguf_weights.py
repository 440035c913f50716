"""Stream dequantized tensors out of a GGUF file, under Hugging Face parameter names.

gguf-py and transformers do the hard parts: gguf's tensor name map (Hugging Face module
name -> llama.cpp name), its dequantizers, and transformers' per-architecture fix-ups
(``TENSOR_PROCESSORS``: un-permuting Llama q/k, Gemma's ``norm - 1``). Compared with
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` this

* yields one tensor at a time instead of holding a float32 copy of the whole model,
* does not parse the file again (the config and tokenizer share one reader), and
* builds gguf's name map once instead of once per submodule (seconds per model).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm


def gguf_weights(gguf_file: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, float tensor)`` for each tensor of ``gguf_file``."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    from runtime.model_loader.gguf_reader import gguf_reader

    reader = gguf_reader(gguf_file)  # parsed once per process, shared with the config and tokenizer
    gguf_arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())
    name_map = gguf_to_hf_names(gguf_arch, hf_config, processor)
    for tensor in tqdm(reader.tensors, desc="Loading GGUF tensors", unit="tensor"):
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}
        )
        if result.name not in name_map:  # e.g. llama.cpp's precomputed rope_freqs
            continue
        yield name_map[result.name], torch.from_numpy(np.array(result.weights, copy=True))


def gguf_to_hf_names(gguf_arch: str, hf_config, processor) -> dict[str, str]:
    """``{"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight", ...}``."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == gguf_arch), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {gguf_arch!r} is unknown to the installed gguf package")
    tensor_names = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    mapping: dict[str, str] = {}
    for hf_name in _hf_parameter_names(hf_config):
        name = processor.preprocess_name(hf_name)
        base, dot, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = name, "", ""
        gguf_name = tensor_names.get_name(base)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(mapping, dot + suffix, "", name)
        else:
            mapping[gguf_name + dot + suffix] = hf_name
    return mapping


def _hf_parameter_names(hf_config) -> list[str]:
    """Parameter names of the transformers model for ``hf_config``, built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
    return list(skeleton.state_dict())
