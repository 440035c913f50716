"""Reference outputs from Hugging Face transformers, and vLLM-style comparisons.

``make_prompts`` and ``reference_outputs`` serve the tiny untokenized checkpoints of
:func:`runtime.testing.models.build_untokenized_model` (vocabulary ``VOCAB_SIZE``).
"""

from __future__ import annotations

import random

import torch

from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE as VOCAB_SIZE

PROMPT_LENS = [5, 17, 33, 9, 41]
SHARED_PREFIX = 24


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, num_logprobs: int = 5):
    """Greedy ``generate`` per prompt with EOS disabled: (token ids, per-step top-k logprob dicts)."""
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        steps = []
        for logits in out.logits:
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            top = torch.topk(logprobs, num_logprobs)
            steps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
        results.append((tokens, steps))
    return results


def check_outputs_equal(expected: list[list[int]], actual: list[list[int]], label: str) -> None:
    for i, (e, a) in enumerate(zip(expected, actual)):
        assert e == a, f"{label}: prompt {i} differs at position {next(j for j, (x, y) in enumerate(zip(e, a)) if x != y) if e[:len(a)] != a[:len(e)] else min(len(e), len(a))}:\n hf:      {e}\n runtime: {a}"


def check_logprobs_close(hf_steps: list[dict], runtime_logprobs: list[dict], atol: float, label: str) -> None:
    """Each position's top tokens agree and their logprobs are within ``atol``."""
    for pos, (ref, ours) in enumerate(zip(hf_steps, runtime_logprobs)):
        common = set(ref) & set(ours)
        assert len(common) >= len(ref) - 1, f"{label}: position {pos} top tokens differ: {sorted(ref)} vs {sorted(ours)}"
        for token in common:
            diff = abs(ref[token] - ours[token].logprob)
            assert diff <= atol, f"{label}: position {pos} token {token}: hf {ref[token]:.5f} vs runtime {ours[token].logprob:.5f}"


def check_logprobs_close_until_divergence(
    ref_tokens: list[int], ref_steps: list[dict], tokens: list[int], logprobs: list[dict], atol: float, label: str
) -> None:
    """Reduced-precision comparison: logprobs close while the tokens agree; at the first
    differing token each side's choice must be among the other's top logprobs (a near-tie)."""
    for pos, (ref_token, token) in enumerate(zip(ref_tokens, tokens)):
        ref, ours = ref_steps[pos], logprobs[pos]
        if ref_token != token:
            assert token in ref and ref_token in ours, (
                f"{label}: position {pos}: runtime chose {token}, hf chose {ref_token}; "
                f"hf top {sorted(ref)}, runtime top {sorted(ours)}"
            )
            return
        for t in set(ref) & set(ours):
            diff = abs(ref[t] - ours[t].logprob)
            assert diff <= atol, f"{label}: position {pos} token {t}: hf {ref[t]:.4f} vs runtime {ours[t].logprob:.4f}"


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Distinct prompts and prompts sharing a prefix (for prefix caching)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(SHARED_PREFIX)]
    distinct = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]
    return distinct + [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n % 7 + 1)] for n in PROMPT_LENS[:3]]


def reference_outputs(path: str, prompts: list[list[int]], num_new_tokens: int):
    """transformers' greedy tokens and top-5 logprobs per step, on the CPU in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(hf, prompts, num_new_tokens)
