"""Stream dequantized tensors out of a GGUF file, under Hugging Face parameter names.

gguf-py and transformers do the hard parts: gguf's tensor name map (Hugging Face module
name -> llama.cpp name), its dequantizers, and transformers' per-architecture fix-ups
(``TENSOR_PROCESSORS``: un-permuting Llama q/k, Gemma's ``norm - 1``). Compared with
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` this

* yields one tensor at a time instead of holding a float32 copy of the whole model,
* does not parse the file again (the config and tokenizer share one reader), and
* builds gguf's name map once instead of once per submodule (seconds per model).

With ``packed`` (the weight names of layers whose quant method keeps GGUF blocks, see
:class:`runtime.quantization.QuantConfig`) those weights arrive as their raw blocks instead:
``<module>.qweight_type`` (int64 [], the ggml type) then ``<module>.qweight`` (uint8
[out, bytes per row]); a type outside ``packed_types`` arrives dequantized, as ggml type F32
with float32 [out, in], and a log line names it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)
F32 = 0  # ggml's type id of float32
UNQUANTIZED = (0, 1, 30)  # F32, F16, BF16



def gguf_weights(
    gguf_file: str, hf_config, packed: Collection[str] = (), packed_types: Collection[int] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, float tensor)`` for each tensor of ``gguf_file``; the weights
    named in ``packed`` as raw blocks (``qweight_type``, ``qweight``) where their type is in
    ``packed_types``."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    from runtime.model_loader.gguf_reader import gguf_reader

    reader = gguf_reader(gguf_file)  # parsed once per process, shared with the config and tokenizer
    gguf_arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())
    name_map = gguf_to_hf_names(gguf_arch, hf_config, processor)
    _check_types(reader.tensors, name_map, packed_types)
    for tensor in tqdm(reader.tensors, desc="Loading GGUF tensors", unit="tensor"):
        hf_name = name_map.get(tensor.name)
        ggml_type = int(tensor.tensor_type)
        keep = hf_name in packed and ggml_type in packed_types
        # Raw blocks go through the same fix-ups: they only reorder whole rows (Llama's q/k).
        weights = tensor.data if keep else dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}
        )
        if result.name not in name_map:  # e.g. llama.cpp's precomputed rope_freqs
            continue
        out = torch.from_numpy(np.array(result.weights, copy=True))
        if hf_name not in packed:
            yield name_map[result.name], out
            continue
        if not keep and ggml_type not in UNQUANTIZED:
            logger.warning("%s: ggml type %s is not kept packed; dequantized at load", hf_name, tensor.tensor_type.name)
        module = hf_name.removesuffix(".weight")
        yield f"{module}.qweight_type", torch.tensor(ggml_type if keep else F32)
        yield f"{module}.qweight", out if keep else out.float()


def readable_types() -> list[str]:
    """Names of the ggml types gguf-py's ``dequantize`` reads (F32, F16 and its quant types)."""
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", {})
    return ["F32", "F16", *sorted(t.name for t in traits if t.name not in ("F32", "F16"))]


def _check_types(tensors, name_map: dict[str, str], packed_types: Collection[int]) -> None:
    """Refuse, before reading any weights, a model tensor of a ggml type that nothing here reads."""
    readable = set(readable_types())
    for tensor in tensors:
        kind = tensor.tensor_type
        if tensor.name in name_map and kind.name not in readable and int(kind) not in packed_types:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} ({name_map[tensor.name]}) has ggml type {kind.name}, which cannot be "
                f"dequantized; supported types: {', '.join(readable_types())}"
            )


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
