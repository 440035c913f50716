"""A vLLM command line works on ``runtime serve``: names, chat template, logprob limit, generation config,
request and stats logging, and vLLM's metric names on /metrics (a real server, the official client)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from support.remote_server import SERVER_FLAGS, running_server, wait_for

NAMES = ["tiny", "alias"]
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_compat")
    (folder / "template.jinja").write_text(TEMPLATE)
    generation = folder / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 3}))
    flags = SERVER_FLAGS + [
        "--served-model-name", *NAMES, "-tp", "1", "--chat-template", str(folder / "template.jinja"),
        "--max-logprobs", "5", "--generation-config", str(generation), "--trust-remote-code",
        "--tokenizer-mode", "auto",
    ]
    with running_server(tiny_llama, flags, folder / "server.log", env={"RUNTIME_LOG_STATS_INTERVAL": "0.5"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, model="tiny", **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **kwargs)


def test_several_served_model_names(client):
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:  # any name is accepted; responses carry the first, as vLLM's do
        assert client.completions.create(model=name, prompt="Hello", max_tokens=1).model == "tiny"
    with pytest.raises(openai.NotFoundError, match="this server serves: tiny, alias"):
        client.completions.create(model="other", prompt="Hello", max_tokens=1)


def test_chat_template_flag_replaces_the_models_template(server, client, tiny_llama):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tiny_llama).encode("<<hi>>", add_special_tokens=False)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(server.url + "/tokenize", json=body).json()["tokens"] == expected
    assert chat(client, max_tokens=1).usage.prompt_tokens == len(expected)


def test_max_logprobs_flag_gives_400_naming_both_numbers(client):
    with pytest.raises(openai.BadRequestError, match="logprobs asks for 6 logprobs, more than max_logprobs 5"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=1, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="asks for 6 logprobs, more than max_logprobs 5"):
        chat(client, max_tokens=1, logprobs=True, top_logprobs=6)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=1, logprobs=5)
    assert len(out.choices[0].logprobs.top_logprobs[0]) == 5


def test_generation_config_gives_the_defaults_a_request_leaves_unset(client):
    default = chat(client, extra_body=NO_EOS)  # no max_tokens, no top_k: the folder's max_new_tokens 3, top_k 1
    greedy = chat(client, temperature=0.0, max_tokens=3, extra_body=NO_EOS)
    assert default.usage.completion_tokens == 3
    assert default.choices[0].message.content == greedy.choices[0].message.content
    assert chat(client, max_tokens=5, extra_body=NO_EOS).usage.completion_tokens == 5  # the request's own value wins


def test_the_generation_config_max_tokens_is_clamped_to_the_context(client):
    """As vLLM: the model's default max_new_tokens (3) is a cap, so a prompt that leaves less room gets what is left
    rather than a 400 about a max_tokens the request never set; a request's own max_tokens is still checked."""
    prompt = [5] * 254  # SERVER_FLAGS' max_model_len 256: room for 2
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=None, extra_body=NO_EOS)
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 253}],
                                         extra_body=NO_EOS)  # templated: 255 tokens
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (255, 1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256") as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    assert info.value.body["param"] == "max_tokens"


def test_vllm_metric_names_and_inter_token_latency(server, client):
    def itl_count(prefix: str) -> float:  # vLLM's names are labelled by engine core (one here)
        return server.metric(prefix + "inter_token_latency_seconds_count", **({"engine": "0"} if prefix == "vllm:" else {}))

    before = {p: itl_count(p) for p in ("vllm:", "runtime:")}
    client.completions.create(model="tiny", prompt="Hello", max_tokens=6, extra_body=NO_EOS)
    for prefix, count in before.items():
        assert itl_count(prefix) == count + 5  # 6 tokens: 5 gaps
    names = {name for name, _ in server.metrics()}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket"):
        assert name in names, name
    assert server.metric("vllm:request_success_total", engine="0", finished_reason="length") >= 1
    assert server.metric("vllm:generation_tokens_total", engine="0") == server.metric("runtime:generation_tokens_total")


def test_vllm_request_phase_and_parameter_metrics(server, client):
    """vLLM's queue / prefill / decode / inference histograms, the request parameter histograms and the tokens per
    step, scraped from /metrics: one sample per request, and values that add up."""

    def vllm(name: str, **labels) -> float:
        return server.metric("vllm:" + name, engine="0", **labels)

    names = [f"request_{p}_time_seconds_{s}" for p in ("queue", "prefill", "decode", "inference") for s in ("sum", "count")]
    names += ["time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum", "iteration_tokens_total_sum",
              "prefix_cache_hits_total", "request_params_n_sum", "request_params_n_count",
              "request_max_num_generation_tokens_sum", "request_params_max_tokens_sum", "request_params_max_tokens_count"]
    before = {name: vllm(name) for name in names}
    out = client.completions.create(model="tiny", prompt="Phases of one request", max_tokens=6, n=2, extra_body=NO_EOS)
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0)
    delta = {name: vllm(name) - value for name, value in before.items()}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta[f"request_{phase}_time_seconds_count"] == 2, phase  # each of the n completions
    # inference = prefill + decode; the front end's TTFT holds the engine's queue and prefill, e2e all of them
    phase = {p: delta[f"request_{p}_time_seconds_sum"] for p in ("queue", "prefill", "decode", "inference")}
    assert phase["inference"] == pytest.approx(phase["prefill"] + phase["decode"])
    assert 0 < phase["queue"] + phase["prefill"] <= delta["time_to_first_token_seconds_sum"]
    assert phase["queue"] + phase["inference"] <= delta["e2e_request_latency_seconds_sum"]
    # Every prompt token of both completions is computed or found cached, then 5 decode steps each.
    assert delta["iteration_tokens_total_sum"] + delta["prefix_cache_hits_total"] == 2 * (out.usage.prompt_tokens + 5)
    assert (delta["request_params_n_count"], delta["request_params_n_sum"]) == (1, 2)
    assert delta["request_max_num_generation_tokens_sum"] == 6
    assert (delta["request_params_max_tokens_count"], delta["request_params_max_tokens_sum"]) == (2, 12)


def test_requests_and_periodic_stats_are_logged(server, client):
    client.completions.create(model="tiny", prompt="Log me", max_tokens=2)
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log()
    assert "Received request cmpl-" in log and "prompt: 'Log me'" in log
    assert "Avg prompt throughput: " in log and "Running: " in log
    assert "default sampling parameters from the model's generation config" in log


def test_allowed_token_ids_restrict_the_sampled_tokens(server, client, tiny_llama):
    """vLLM's ``allowed_token_ids``: every sampled token is one of them (greedy, and random with n > 1, streamed too);
    an empty list or an id outside the vocabulary is a 400 naming the field."""
    from transformers import AutoTokenizer

    allowed = [100, 200, 300, 400]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert len(texts) == len(allowed)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, logprobs=1, temperature=0.0,
                                    extra_body={"allowed_token_ids": allowed, **NO_EOS})
    assert len(out.choices[0].logprobs.tokens) == 6 and set(out.choices[0].logprobs.tokens) <= texts
    sampled = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=1,
                                        logprobs=1, stream=True, extra_body={"allowed_token_ids": allowed, **NO_EOS})
    tokens: dict[int, list[str]] = {}
    for chunk in sampled:
        for choice in chunk.choices:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 and set(t) <= texts for t in tokens.values()), tokens
    for bad in ([], [10**9]):
        response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "allowed_token_ids": bad})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "allowed_token_ids" and "allowed_token_ids" in error["message"], error


def test_bad_words_reach_the_engine(server, client):
    """vLLM's ``bad_words`` through the server: a word of the free output is not generated again; a blank word is a
    400 naming the field."""
    free = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0.0, extra_body=NO_EOS)
    word = free.choices[0].text.split()[1]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0.0,
                                    extra_body={"bad_words": [word], **NO_EOS})
    assert out.choices[0].text != free.choices[0].text and word not in out.choices[0].text.split()
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "bad_words": ["  "]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words", response.text
