"""Hugging Face transformers as the peer in benchmarks: padded ``generate`` and ``generate_batch``."""

from __future__ import annotations

import os
import time

import torch


def load_hf_model(model: str, dtype: torch.dtype | None, dummy: bool, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, gguf = (os.path.dirname(model), os.path.basename(model)) if model.endswith(".gguf") else (model, None)
    kwargs = {"gguf_file": gguf} if gguf else {}
    if dummy:
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(folder, **kwargs)
        # Random init on the GPU: an 8B model takes minutes to initialize on the CPU.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", **kwargs)
    if torch.cuda.is_available():
        hf = hf.to("cuda")
    return hf.eval()


def _progress_bar(total: int, show: bool):
    """Requests done so far, on stderr (as the engine's own run shows them)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="transformers requests", unit="req", disable=not show)


@torch.inference_mode()
def hf_generate_padded(model, workload, batch_size: int, show_progress: bool = False) -> float:
    """``generate`` over left-padded batches in arrival order; each batch runs to its longest output."""
    pad = 0
    progress = _progress_bar(len(workload.prompts), show_progress)
    start = time.perf_counter()
    for lo in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[lo : lo + batch_size]
        new_tokens = max(workload.output_lens[lo : lo + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        progress.update(len(prompts))
    elapsed = time.perf_counter() - start
    progress.close()
    return elapsed


def hf_generate_batch(model, workload, max_batch_tokens: int, show_progress: bool = False) -> float:
    """transformers' continuous batching (paged attention) with per-request output lengths."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,  # run every request to its length, like ignore_eos
        pad_token_id=0,
        max_batch_tokens=max_batch_tokens,
    )
    progress = _progress_bar(len(workload.prompts), show_progress)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            manager.add_request(input_ids=prompt, request_id=f"r{i}", max_new_tokens=n)
        produced = {}
        while len(produced) < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers generate_batch failed request {result.request_id}: {result.error}")
                produced[result.request_id] = len(result.generated_tokens)
                progress.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    progress.close()
    expected = {f"r{i}": n for i, n in enumerate(workload.output_lens)}
    if produced != expected:
        wrong = [k for k in expected if produced.get(k) != expected[k]][:3]
        raise RuntimeError(f"generate_batch produced wrong lengths, e.g. {[(k, produced.get(k), expected[k]) for k in wrong]}")
    return time.perf_counter() - start
