"""Tiny checkpoints written as GGUF files (float32 tensors, no tokenizer) with gguf-py's writer.

``write_qwen2_gguf`` converts a tiny qwen2 Hugging Face folder (``build_untokenized_model``)
the way llama.cpp's converter lays it out: ``qwen2.*`` hyperparameters, tensors under gguf's
name map (``blk.N.attn_q.weight`` ...), the tied LM head left out. qwen2 needs no q/k
permutation (llama would) and has plain RoPE, so the GGUF holds exactly the folder's model.
"""

from __future__ import annotations

import os

import torch


def write_qwen2_gguf(hf_folder: str, gguf_file, linear_type=None) -> str:
    """Write the qwen2 checkpoint at ``hf_folder`` to ``gguf_file`` (float32; with ``linear_type``, a
    ``gguf.GGMLQuantizationType`` gguf-py can quantize (Q8_0, Q4_0 ...), the linear layers' weights in
    its blocks); return its path."""
    from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map, quants
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    assert config.model_type == "qwen2" and config.tie_word_embeddings, config
    tensors = load_file(os.path.join(hf_folder, "model.safetensors"))
    gguf_file = str(gguf_file)
    os.makedirs(os.path.dirname(gguf_file), exist_ok=True)
    writer = GGUFWriter(gguf_file, "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    name_map = get_tensor_name_map(MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in tensors.items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = name_map.get_name(base)
        assert gguf_name is not None, name
        data = tensor.to(torch.float32).numpy()
        if linear_type is not None and data.ndim == 2 and "embed_tokens" not in name:
            writer.add_tensor(f"{gguf_name}.{suffix}", quants.quantize(data, linear_type), raw_dtype=linear_type)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_file
