"""The offline ``LLM`` has vLLM's public methods and keywords: collective_rpc, reset_prefix_cache, and chat's
chat_template, continue_final_message, tools and content parts."""

from __future__ import annotations

import time

import pytest

from runtime import LLM, SamplingParams
from runtime.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
ECHO_TEMPLATE = (
    "{% if tools %}[tools:{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}{{ c['function']['arguments']['city'] }}"
    "{% endfor %}{% endif %}{% if not loop.last or not continue_final_message %}</>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from runtime.testing.models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_model_len=128, block_size=4, enable_prefix_caching=True)


def test_collective_rpc_calls_a_worker_method_by_name(llm, monkeypatch):
    worker = llm.llm_engine.engine_core.executor.worker
    assert llm.collective_rpc("describe") == [worker.describe()]
    monkeypatch.setattr(Worker, "echo", lambda self, a, b=0: (self.rank, a, b), raising=False)
    assert llm.collective_rpc("echo", args=(5,), kwargs={"b": 7}) == [(0, 5, 7)]
    assert llm.collective_rpc("echo", None, (1,)) == [(0, 1, 0)]  # vLLM's positional order: method, timeout, args
    with pytest.raises(TypeError, match=r"collective_rpc takes the name of a Worker method \(a str\)"):
        llm.collective_rpc(lambda worker: worker.rank)
    # the engine still generates after the calls
    assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_collective_rpc_timeout_raises_timeout_error(llm, monkeypatch):
    monkeypatch.setattr(Worker, "nap", lambda self, s: time.sleep(s), raising=False)
    with pytest.raises(TimeoutError, match="nap"):
        llm.collective_rpc("nap", timeout=0.05, args=(0.5,))
    assert llm.collective_rpc("describe", timeout=30) == [llm.llm_engine.engine_core.executor.worker.describe()]


def test_collective_rpc_reaches_every_worker_process(model_path):
    """Two tensor-parallel workers in their own processes (multiproc executor): one result per rank, in order."""
    tp = LLM(model_path, dtype="float32", max_model_len=64, tensor_parallel_size=2)
    try:
        assert tp.collective_rpc("__getattribute__", args=("rank",)) == [0, 1]
        assert [d["collectives"] for d in tp.collective_rpc("describe", timeout=60)] == ["torch.distributed (gloo)"] * 2
    finally:
        tp.llm_engine.engine_core.shutdown()


def test_reset_prefix_cache(llm):
    prompt = {"prompt_token_ids": list(range(100, 120))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.kv_cache_manager.stats
    hits = stats.hits
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert stats.hits > hits  # the prefix was cached
    assert llm.reset_prefix_cache() is True
    hits = stats.hits
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert stats.hits == hits  # nothing left to hit


def chat_prompt(llm, messages, **options) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **options)[0].prompt


def test_chat_takes_vllms_template_options(llm):
    user = [{"role": "user", "content": "hi"}]
    assert chat_prompt(llm, user, chat_template=ECHO_TEMPLATE) == "<user>hi</><assistant>"
    assert chat_prompt(llm, user, chat_template=ECHO_TEMPLATE, add_generation_prompt=False) == "<user>hi</>"
    partial = user + [{"role": "assistant", "content": "Hel"}]
    assert chat_prompt(llm, partial, chat_template=ECHO_TEMPLATE, add_generation_prompt=False,
                       continue_final_message=True) == "<user>hi</><assistant>Hel"
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be true"):
        chat_prompt(llm, partial, chat_template=ECHO_TEMPLATE, continue_final_message=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat_prompt(llm, user, chat_template=ECHO_TEMPLATE, tools=tools).startswith("[tools:get_weather]<user>")
    # chat_template_kwargs win over the keywords, as in vLLM
    assert chat_prompt(llm, user, chat_template=ECHO_TEMPLATE,
                       chat_template_kwargs={"add_generation_prompt": False}) == "<user>hi</>"
    # without chat_template the model's own template is used
    assert chat_prompt(llm, user) == llm.get_tokenizer().apply_chat_template(user, tokenize=False,
                                                                             add_generation_prompt=True)


def test_chat_reads_openai_content_parts_and_tool_call_arguments(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_prompt(llm, parts, chat_template=ECHO_TEMPLATE) == "<user>a\nb</><assistant>"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert chat_prompt(llm, history, chat_template=ECHO_TEMPLATE, add_generation_prompt=False) == \
        "<user>weather?</><assistant>Paris</>"
    openai_format = "{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"
    assert chat_prompt(llm, [{"role": "user", "content": "x"}], chat_template=openai_format,
                       chat_template_content_format="openai") == "x"
    with pytest.raises(ValueError, match="only text content parts are supported, got 'image_url'"):
        chat_prompt(llm, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    with pytest.raises(ValueError, match="chat_template_content_format 'xml' is not valid"):
        chat_prompt(llm, parts, chat_template_content_format="xml")


def test_lora_request_is_accepted_as_none_and_refused_otherwise(llm):
    assert llm.generate("hi", GREEDY, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request=object())
    assert not llm.llm_engine.has_unfinished_requests()


def reference_beams(model_path, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Beam search by hand over transformers' logits: every beam's top 2*width tokens, the best width kept."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    beams = [(list(prompt), 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            candidates = []
            for tokens, cum in beams:
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
                top = torch.topk(logprobs, 2 * width)
                candidates += [(tokens + [t], cum + lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())]
            beams = sorted(candidates, key=lambda b: b[1], reverse=True)[:width]
    return beams


def test_beam_search_matches_a_reference_over_transformers(llm, model_path):
    from runtime.sampling_params import BeamSearchParams  # where vLLM users import it from

    prompt = [5, 60, 700, 81, 9]
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    expected = reference_beams(model_path, prompt, 3, 4)
    assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
    for seq, (_, cum) in zip(out.sequences, expected):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert seq.text == llm.get_tokenizer().decode(seq.tokens) and len(seq.logprobs) == 4
    texts = llm.beam_search(["hello there", {"prompt": "a b"}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert [len(o.sequences) for o in texts] == [2, 2]
    with pytest.raises(ValueError, match="beam_width must be an integer of at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(TypeError, match="beam_search takes BeamSearchParams"):
        llm.beam_search(["hi"], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
