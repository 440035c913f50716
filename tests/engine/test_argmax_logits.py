"""Steps whose rows take the argmax alone read the logits in the lm_head's dtype (no float32 copy of
[rows, vocab]); a row that reads the logits back (logprobs here) gets them widened. The tokens are those of the
widened logits: a bf16 model generates the same with the shortcut removed."""

from __future__ import annotations

import torch

from runtime import LLM, SamplingParams
from runtime.models.llama import LlamaForCausalLM
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import make_prompts


def test_a_final_softcap_keeps_the_float_logits(tmp_path):
    """Gemma 3's softcap is monotone but, in float32, may make two logits equal: argmax-only steps take its capped
    float logits, exactly what compute_logits gives."""
    from runtime.model_loader import load_model, resolve_model

    resolved = resolve_model(build_untokenized_model("gemma3", tmp_path / "gemma3"))
    model = load_model(resolved, dtype=torch.bfloat16, device="cpu")
    hidden = torch.randn(3, resolved.hf_config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert resolved.hf_config.final_logit_softcapping is not None
        capped = model.compute_logits_for_argmax(hidden)
        assert capped.dtype == torch.float32 and torch.equal(capped, model.compute_logits(hidden))
        resolved.hf_config.final_logit_softcapping = None  # without one: the lm_head's bf16
        assert model.compute_logits_for_argmax(hidden).dtype == torch.bfloat16


def test_plain_greedy_steps_skip_widening_the_logits(tmp_path, monkeypatch):
    path = build_untokenized_model("llama", tmp_path / "llama")
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    calls = {"argmax": [], "float": []}
    real_argmax, real_float = LlamaForCausalLM.compute_logits_for_argmax, LlamaForCausalLM.compute_logits

    def for_argmax(self, hidden):
        out = real_argmax(self, hidden)
        calls["argmax"].append(out.dtype)
        return out

    def widened(self, hidden):
        calls["float"].append(None)
        return real_float(self, hidden)

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits_for_argmax", for_argmax)
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", widened)
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=True)
    calls["argmax"].clear(), calls["float"].clear()  # start-up's sampling warm-up takes both
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls["argmax"] and set(calls["argmax"]) == {torch.bfloat16}
    assert not calls["float"]

    calls["argmax"].clear(), calls["float"].clear()
    with_logprobs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
                                 use_tqdm=False)
    assert calls["float"] and not calls["argmax"]  # every step widened
    assert [o.outputs[0].token_ids for o in with_logprobs] == fast
    del llm

    # the same steps with the logits widened first, as before the shortcut
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits_for_argmax",
                        lambda self, hidden: real_argmax(self, hidden).float())
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == fast
