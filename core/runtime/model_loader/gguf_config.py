"""GGUF metadata that transformers' GGUF config reader leaves out, applied to its config.

transformers maps a fixed set of ``<arch>.*`` keys per architecture. llama.cpp's files carry more
that change the model (and a part of a split model is refused: one file holds the whole model):

* ``<arch>.attention.key_length``: the head size where it is not hidden / heads (Qwen3; any
  architecture whose converter wrote it);
* ``<arch>.rope.scaling.type`` / ``.factor`` / ``.original_context_length`` (and the older
  ``<arch>.rope.scale_linear``): RoPE scaling. Gemma 3 scales its global layers only;
* the ``rope_freqs.weight`` tensor: Llama 3.1+'s RoPE scaling, stored as one factor per frequency
  instead of as keys; it is read back into ``llama3`` parameters that give the same factors;
* ``gemma3.rope.freq_base_swa``: the RoPE base of Gemma 3's sliding layers;
* Gemma 3's query scale, which the file does not hold: llama.cpp takes 1 / sqrt(head size), and
  1 / sqrt(hidden / heads) for the 62-layer 27B (transformers' default, 256, fits neither in general);
* the vocabulary size, from ``token_embd.weight`` where the file names none and has no tokenizer;
* the end-of-generation tokens llama.cpp stops at: the EOS, EOT, EOM and FIM pad/repo/separator ids,
  and the tokens spelled as a known end of turn (Gemma's ``<end_of_turn>``, which its files do not
  name as EOS). They become ``eos_token_id`` (a list, the file's EOS first), as a Hugging Face
  ``generation_config.json`` lists them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ROPE_FREQS = "rope_freqs.weight"
GEMMA3_27B_LAYERS = 62
END_OF_GENERATION_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
# Token texts llama.cpp (llama-vocab.cpp) treats as an end of generation wherever they are in the vocabulary.
END_OF_GENERATION_TEXTS = frozenset(t.encode() for t in (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>",
))
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def apply_gguf_metadata(config, gguf_file: str):
    """Complete transformers' ``config`` of ``gguf_file`` with the keys above; returns it."""
    from runtime.model_loader.gguf_reader import gguf_reader

    reader = gguf_reader(gguf_file)
    parts = _field(reader, "split.count", 1)
    if parts > 1:  # as vLLM: one file per model
        raise ValueError(f"it is part {_field(reader, 'split.no', 0) + 1} of a model split into {parts} files; merge "
                         "them into one first (llama.cpp: llama-gguf-split --merge FIRST_PART OUTPUT.gguf)")
    arch = _field(reader, "general.architecture")
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    if arch == "gemma3":
        is_27b = config.num_hidden_layers == GEMMA3_27B_LAYERS
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if is_27b else head_dim_of(config)
    if _field(reader, f"{arch}.vocab_size") is None and "tokenizer.ggml.tokens" not in reader.fields:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is not None:
            config.vocab_size = int(embedding.shape[-1])  # gguf shapes are [in, out]: [hidden, vocab]
    stops = end_of_generation_ids(reader)
    if stops:
        config.eos_token_id = stops if len(stops) > 1 else stops[0]
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return config
    nested = "full_attention" in params and isinstance(params["full_attention"], dict)
    scaled = dict(params["full_attention"] if nested else params)
    scaled.update(_rope_scaling(reader, arch))
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        from gguf import dequantize

        factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1)
        scaled.update(llama3_from_factors(factors, float(scaled.get("rope_theta", 10000.0)), head_dim_of(config)))
    if not nested:
        config.rope_parameters = scaled
        return config
    layers = {**params, "full_attention": scaled}
    swa_base = _field(reader, f"{arch}.rope.freq_base_swa")
    if swa_base is not None and isinstance(params.get("sliding_attention"), dict):
        layers["sliding_attention"] = {**params["sliding_attention"], "rope_theta": float(swa_base)}
    config.rope_parameters = layers
    return config


def end_of_generation_ids(reader) -> list[int]:
    """The ids llama.cpp ends generation at (see the module docstring), the file's EOS first."""
    ids = [int(_field(reader, f"tokenizer.ggml.{key}_token_id")) for key in END_OF_GENERATION_KEYS
           if _field(reader, f"tokenizer.ggml.{key}_token_id") is not None]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        ids += [i for i, part in enumerate(tokens.data) if tokens.parts[part].tobytes() in END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(ids))


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_scaling(reader, arch: str) -> dict[str, Any]:
    """RoPE settings from the ``<arch>.rope.scaling.*`` keys (empty when the file has none)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _field(reader, f"{arch}.rope.scale_linear") is not None:  # the older key
        kind, factor = "linear", _field(reader, f"{arch}.rope.scale_linear")
    if kind is None or kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {}
    out: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        out["factor"] = float(factor)
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("attn_factor", "attention_factor")):
        value = _field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            out[name] = float(value)
    return out


def _llama3_factors(theta: float, head_dim: int, params: dict[str, float]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for these ``llama3`` parameters."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    smooth = (old / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / params["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, params["factor"], medium))


def llama3_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """``llama3`` RoPE parameters whose per-frequency divisors are ``factors`` (a ``rope_freqs`` tensor).

    The divisors are 1 for high frequencies, ``factor`` for low ones and blend in between, where
    ``1 / f`` is linear in ``1 / wavelength``; that line gives the band's edges. Raises ValueError
    when no such parameters reproduce the tensor."""
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"GGUF tensor {ROPE_FREQS!r} has {factors.size} values; the model's head size {head_dim} "
                         f"needs {head_dim // 2} (one per rotary frequency)")
    if np.allclose(factors, 1.0):
        return {}
    factor = float(factors.max())
    candidates = [{"factor": factor, **LLAMA3_DEFAULTS}]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if medium.sum() >= 2 and factor > 1:
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)  # = old / wavelen / (high - low) - low / (high - low)
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        if intercept < 0 and slope > 0:  # low_freq_factor 1: old = slope / -intercept, high = 1 + old / slope
            old = slope / -intercept
            high = 1 + old / slope
            for rounded in (True, False):  # whole numbers where they fit (8192 and 4.0, not 8191.9997)
                candidates.append({"factor": factor, "low_freq_factor": 1.0,
                                   "high_freq_factor": float(f"{high:.6g}") if rounded else float(high),
                                   "original_max_position_embeddings": round(old) if rounded else float(old)})
    for params in candidates:
        if np.allclose(_llama3_factors(theta, head_dim, params), factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", **params}
    raise ValueError(f"GGUF tensor {ROPE_FREQS!r} holds RoPE frequency factors (from {factors.min():g} to "
                     f"{factor:g}) that no llama3 RoPE scaling gives; only llama3-style factors are supported")
