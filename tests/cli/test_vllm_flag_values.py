"""vLLM flags of ``runtime serve`` that were missing or misread, and bad flag values refused before the model loads
with a message naming the flag."""

from __future__ import annotations

import pytest

from runtime.cli import serve
from runtime.cli.args import engine_args_from_namespace
from runtime.cli.main import build_parser
from runtime.engine_args import EngineArgs


def parse_serve(*argv: str):
    return build_parser(load_plugins=False).parse_args(["serve", "MODEL", *argv])


@pytest.fixture
def no_server(monkeypatch):
    """``runtime serve`` up to the point where it would start the engine: that point must not be reached."""
    import runtime.entrypoints.openai.api_server as api_server

    def run_server(args, engine_args):
        raise AssertionError("a bad flag value got as far as starting the server")

    monkeypatch.setattr(api_server, "run_server", run_server)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--port", "70000"), "--port must be a TCP port in 0..65535 (0: any free port), got 70000"),
        (("--port", "-1"), "--port must be a TCP port in 0..65535"),
        (("--max-concurrent-requests", "-1"), "--max-concurrent-requests must be >= 1, or 0 for no limit, got -1"),
        (("--limit-mm-per-prompt", '{"image": 2}'), '--limit-mm-per-prompt {"image": 2}: this server runs text-only'),
        (("--limit-mm-per-prompt", '{"image": {"count": 1}}'), "--limit-mm-per-prompt"),
    ],
)
def test_bad_front_end_values_are_refused_naming_the_flag(no_server, argv, message):
    with pytest.raises(ValueError) as error:  # ``runtime`` prints it as "runtime: error: ..." and exits with 2
        serve.run(parse_serve(*argv))
    assert message in str(error.value)


def test_allowed_origins_takes_vllms_json_list():
    """vLLM's --allowed-origins is a JSON list; split at commas, its brackets and quotes became part of the origins."""
    assert parse_serve("--allowed-origins", '["http://a.example", "http://b.example"]').allowed_origins == (
        "http://a.example,http://b.example"
    )
    assert parse_serve("--allowed-origins", "http://a.example,http://b.example").allowed_origins == (
        "http://a.example,http://b.example"
    )
    assert parse_serve("--allowed-origins", '["*"]').allowed_origins == "*"


def test_allowed_origins_bad_json_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_serve("--allowed-origins", '["http://a.example"')
    assert "argument --allowed-origins: not a valid JSON list" in capsys.readouterr().err


def test_vllm_flags_accepted_and_used():
    args = parse_serve("--swap-space", "8", "--limit-mm-per-prompt", '{"image": 0, "video": {"count": 0}}',
                       "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 7}')
    engine_args = engine_args_from_namespace(args, model="MODEL")
    assert engine_args.swap_space == 8.0
    assert engine_args.override_generation_config == {"temperature": 0.5, "max_new_tokens": 7}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu_num_threads": 0}, "cpu_num_threads must be a positive integer or unset, got 0"),
        ({"cpu_num_threads": -3}, "cpu_num_threads must be a positive integer or unset, got -3"),
        ({"swap_space": -1}, "swap_space must be a number of GiB >= 0, got -1"),
    ],
)
def test_bad_engine_numbers_name_the_argument(kwargs, message):
    """Found before any process starts (cpu_num_threads=0 used to fail inside the engine process, in torch)."""
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="MODEL", **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from runtime.testing.models import build_untokenized_model

    return build_untokenized_model("llama", tmp_path_factory.mktemp("override_gen"))


def test_override_generation_config_sets_the_default_sampling_values(model):
    """As vLLM: the overrides go over the generation config (also over none, with --generation-config vllm);
    max_new_tokens is the default max_tokens."""
    args = parse_serve("--generation-config", "vllm", "--override-generation-config",
                       '{"temperature": 0.25, "top_k": 5, "max_new_tokens": 9}')
    config = engine_args_from_namespace(args, model=model).create_engine_config()
    assert config.model_config.default_sampling_params == {"temperature": 0.25, "top_k": 5, "max_tokens": 9}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"temprature": 0.5}, "override_generation_config: 'temprature' is not a sampling field of the generation "
                              "config; valid: temperature, top_p"),
        ({"temperature": "hot"}, "override_generation_config's temperature must be a number >= 0, got 'hot'"),
        ({"top_p": 0}, r"override_generation_config's top_p must be a number in \(0, 1\], got 0"),
        ({"max_new_tokens": 1.5}, "override_generation_config's max_new_tokens must be an integer >= 1, got 1.5"),
    ],
)
def test_bad_override_generation_config_names_the_key(model, overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model, override_generation_config=overrides).create_engine_config()


@pytest.mark.parametrize(("given", "endpoint"), [("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
                                                 ("chat", "chat")])
def test_bench_serve_takes_vllms_endpoint_path(given, endpoint):
    """``vllm bench serve --endpoint /v1/chat/completions``: the path names the same endpoint as runtime's word."""
    args = build_parser(load_plugins=False).parse_args(["bench", "serve", "--endpoint", given])
    assert args.endpoint == endpoint


def test_bench_serve_unknown_endpoint_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        build_parser(load_plugins=False).parse_args(["bench", "serve", "--endpoint", "/v1/embeddings"])
    assert "argument --endpoint: invalid choice: '/v1/embeddings' (choose from 'completions', 'chat')" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "api_key"),
    [({"VLLM_API_KEY": "v"}, "v"), ({"RUNTIME_API_KEY": "r", "VLLM_API_KEY": "v"}, "r"), ({}, None)],
)
def test_api_key_from_vllms_environment_variable(monkeypatch, env, api_key):
    """A deployment moved from vLLM with VLLM_API_KEY set must not come up without authentication."""
    for name in ("RUNTIME_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parse_serve().api_key == api_key
    assert parse_serve("--api-key", "flag").api_key == "flag"
