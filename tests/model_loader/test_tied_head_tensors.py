"""A checkpoint of a model with tied word embeddings may still hold ``lm_head.*`` tensors (a copy of
the embedding, or the quantized head of a GPTQ ``lm_head: true`` export): they are skipped, as vLLM
skips them, and the logits come from the embedding."""

import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from runtime import LLM, SamplingParams
from runtime.testing.models import build_tiny_model


def test_lm_head_tensors_of_a_tied_model_are_skipped(tmp_path):
    path = build_tiny_model("qwen2", tmp_path / "qwen2")  # tied head
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors["lm_head.qweight"] = torch.zeros(hidden // 8, 16, dtype=torch.int32)  # what a quantized head leaves
    tensors["lm_head.scales"] = torch.ones(1, 16)
    tensors["lm_head.g_idx"] = torch.zeros(hidden, dtype=torch.int32)
    save_file(tensors, file, metadata={"format": "pt"})

    prompt = [5, 77, 301, 12, 9]
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=8)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected
