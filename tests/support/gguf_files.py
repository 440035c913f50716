"""Tiny random GGUF files written the way llama.cpp's converter lays them out, for loader tests.

``write_gguf(path, arch, ...)`` builds a tiny random transformers model of ``arch`` (llama, qwen2,
qwen3, gemma3), writes its hyperparameters under ``<arch>.*`` keys and its tensors under gguf's
name map (Llama's q/k permuted, Gemma's norms stored as ``w + 1``), the linear weights in the ggml
type asked for. Types gguf-py can quantize are quantized from the model's weights; the others
(K-quants, IQ*) are random blocks with small float16 scales. The file, not the model, is then the
reference: transformers reads it with ``from_pretrained(folder, gguf_file=...)``.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

# Byte offsets of each block's float16 scale fields, for random blocks of types gguf-py cannot quantize.
_F16_FIELDS = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
_WIDE_SUB_SCALES = ("Q4_K", "Q5_K", "Q6_K", "IQ3_XXS", "IQ4_XS")  # sub-block scales of 6-8 bits: a smaller d
HIDDEN = 256  # K-quants' blocks are 256 inputs: every linear layer's inputs are a multiple of it


def tiny_config(arch: str, vocab_size: int = 512, **overrides):
    """A tiny transformers config of ``arch``: hidden 256, 4 heads over 2 KV heads of 64, 2 layers (Gemma 3: 6)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma3":  # llama.cpp's Gemma 3: every sixth layer global, queries scaled by 1 / sqrt(head size)
        common.update(query_pre_attn_scalar=64, sliding_window=8, num_hidden_layers=6,
                      layer_types=["sliding_attention"] * 5 + ["full_attention"])
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}[arch]
    return cls(**common)


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw rows uint8 [rows, row bytes] of ``type_name``, whose weights are finite and small."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[type_name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale = 0.0002 if type_name in _WIDE_SUB_SCALES else 0.002
    for offset in _F16_FIELDS.get(type_name, ()):
        halves = (rng.standard_normal((rows, cols // block)) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(rows, cols // block, 2)
    if type_name == "IQ1_M":  # its float16 scale is spread over the top nibbles of four uint16 sub-block scales
        bits = (rng.standard_normal((rows, cols // block)) * 0.002).astype(np.float16).view(np.uint16)
        scales = raw[..., 48:56].copy().view(np.uint16)  # [rows, blocks, 4]
        for i in range(4):
            scales[..., i] = (scales[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[..., 48:56] = scales.view(np.uint8)
    elif type_name == "NVFP4":  # four UE4M3 scales: exponents 1-3 keep them small
        raw[..., 0:4] = rng.integers(0x08, 0x20, (rows, cols // block, 4), dtype=np.uint8)
    raw = raw.reshape(rows, -1)
    weights = dequantize(raw, qtype)
    assert np.isfinite(weights).all() and np.abs(weights).max() < 50, type_name
    return raw


def _encode(data: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return data, None
    try:
        return quants.quantize(data, qtype), qtype
    except NotImplementedError:
        return random_blocks(type_name, data.shape[0], data.shape[1], rng), qtype


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_hparams(writer, arch: str, config, context_length: int | None, skip: set[str]) -> None:
    def add(key: str, fn, *args):
        if key not in skip:
            fn(*args)

    add("context_length", writer.add_context_length, context_length or config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    add("head_count_kv", writer.add_head_count_kv, config.num_key_value_heads)
    add("freq_base", writer.add_rope_freq_base, float(config.rope_parameters.get("rope_theta", 10000.0)
                                                       if "rope_theta" in config.rope_parameters
                                                       else config.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add("vocab_size", writer.add_vocab_size, config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        add("key_length", writer.add_key_length, head_dim)
        add("key_length", writer.add_value_length, head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    add("bos", writer.add_bos_token_id, config.bos_token_id)
    add("eos", writer.add_eos_token_id, config.eos_token_id)


def tiny_model(config, seed: int = 0):
    """The random float32 transformers model ``write_gguf`` writes for ``config`` and ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _rope_scaling(writer, config, head_dim: int) -> dict[str, np.ndarray]:
    """RoPE scaling as llama.cpp's converter writes it: linear as keys (Gemma 3: of its global layers),
    llama3 as a ``rope_freqs`` tensor of per-frequency divisors. Returns the extra tensors."""
    from gguf import RopeScalingType

    params = config.rope_parameters
    params = params.get("full_attention", params)
    if params.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    if params.get("rope_type") != "llama3":
        return {}
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    old = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    factors = []
    for freq in inv_freq.tolist():
        wavelen = 2 * np.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        factors.append(1.0 if wavelen < old / high else factor if wavelen > old / low else 1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(factors, dtype=np.float32)}


def write_gguf(path, arch: str, linear_type: str | list[str] = "F32", embed_type: str = "F32", *, config=None, seed: int = 0,
               context_length: int | None = None, skip_keys: tuple[str, ...] = (), extra=None, tensors_extra=None,
               split_max_tensors: int = 0) -> str:
    """Write ``tiny_model(config or tiny_config(arch), seed)`` to ``path`` (linear weights in ``linear_type``, or
    in the types of a list taken in turn, layer by layer as the model names them; the token embedding and an untied output in ``embed_type``); ``extra(writer)`` adds keys; ``tensors_extra`` more
    tensors ({gguf name: float32 array}). Returns the path."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    config = config or tiny_config(arch)
    model = tiny_model(config, seed)
    rng = np.random.default_rng(seed)
    path = str(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)  # split: PATH-0000N-of-0000M.gguf files
    writer.add_name(f"tiny-{arch}")
    _write_hparams(writer, arch, config, context_length, set(skip_keys))
    tensors_extra = {**_rope_scaling(writer, config, config.head_dim), **(tensors_extra or {})}
    if extra is not None:
        extra(writer)
    gguf_arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    assert gguf_arch in MODEL_ARCH
    name_map = get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    linear_types = itertools.cycle([linear_type] if isinstance(linear_type, str) else linear_type)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        data = tensor.numpy().astype(np.float32)
        if arch == "gemma3" and "norm" in name:
            data = data + 1.0  # llama.cpp stores Gemma's (1 + w)
        if arch == "llama" and ".attn_q." in gguf_name:
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = _permute(data, config.num_key_value_heads)
        qtype = None
        if data.ndim == 2:
            is_linear = not gguf_name.startswith(("token_embd", "output."))
            kind = (next(linear_types) if is_linear else embed_type)
            data, qtype = _encode(data, kind, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    for gguf_name, data in tensors_extra.items():
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_model(path: str):
    """transformers' own reading of the GGUF file at ``path`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "▁w", "he", "ll", "or", "ld", "hell", "hello", "▁wor", "▁world",
              "▁▁", "\n", "user", "us", "er"]


def spm_vocabulary(writer) -> list[str]:
    """Add a tiny Gemma-style sentencepiece vocabulary (``tokenizer.ggml.model`` "llama"): control tokens, the
    256 byte tokens, then pieces in merge order; BOS added, no space prefix, as Gemma 3's files say. Returns it."""
    tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [3] * len(SPM_SPECIALS) + [6] * 256 + [1] * len(SPM_PIECES)  # control, byte, normal
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                             "{{ m['content'] }}<end_of_turn>\n{% endfor %}")
    return tokens
