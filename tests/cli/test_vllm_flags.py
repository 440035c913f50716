"""``runtime serve`` takes vLLM's spellings of the flags a vLLM command line uses."""

from __future__ import annotations

import pytest

from runtime.cli.args import engine_args_from_namespace
from runtime.cli.main import build_parser
from runtime.entrypoints.openai.api_server import serving_context


def parse_serve(*argv: str):
    return build_parser(load_plugins=False).parse_args(["serve", "MODEL", *argv])


def test_vllm_flags_reach_the_engine_arguments():
    args = parse_serve(
        "-tp", "2", "-pp", "3", "-dp", "4", "--served-model-name", "a", "b", "--trust-remote-code", "--tokenizer-mode", "slow",
        "--max-logprobs", "7", "--generation-config", "vllm", "--disable-log-stats", "--chat-template", "x.jinja",
        "-q", "gptq_marlin",
    )
    engine_args = engine_args_from_namespace(args, model=args.model_tag)
    assert (engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size, engine_args.data_parallel_size) == (2, 3, 4)
    assert engine_args.served_model_name == ["a", "b"]
    assert engine_args.trust_remote_code is True
    assert engine_args.tokenizer_mode == "slow"
    assert engine_args.max_logprobs == 7
    assert engine_args.generation_config == "vllm"
    assert engine_args.disable_log_stats is True
    assert engine_args.chat_template == "x.jinja"
    assert engine_args.quantization == "gptq_marlin"  # read as gptq when the engine is built (test_wna16_bad_input.py)


def test_defaults_match_vllm():
    engine_args = engine_args_from_namespace(parse_serve(), model="MODEL")
    assert engine_args.max_logprobs == 20
    assert engine_args.generation_config == "auto"
    assert engine_args.tokenizer_mode == "auto"
    assert engine_args.trust_remote_code is False
    assert engine_args.disable_log_stats is False


def test_more_than_one_worker_defaults_to_the_multiproc_executor(tmp_path):
    """As vLLM picks ``mp``: -tp / -pp above 1 with the executor left alone runs worker processes."""
    from runtime.testing.models import build_untokenized_model

    model = build_untokenized_model("llama", tmp_path)
    for argv, executor in [((), "uniproc"), (("-tp", "2"), "multiproc"), (("-pp", "2"), "multiproc")]:
        config = engine_args_from_namespace(parse_serve(*argv), model=model).create_engine_config()
        assert config.parallel_config.executor == executor, argv
    config = engine_args_from_namespace(parse_serve("-tp", "2", "-pp", "2"), model=model).create_engine_config()
    assert config.parallel_config.world_size == 4
    # vLLM's backend names are registered executors too
    config = engine_args_from_namespace(
        parse_serve("-tp", "2", "--distributed-executor-backend", "mp"), model=model
    ).create_engine_config()
    assert config.parallel_config.executor == "mp"


def test_kv_offload_runs_with_tensor_and_pipeline_parallelism_and_the_ray_executor(tmp_path):
    from runtime.testing.models import build_untokenized_model

    model = build_untokenized_model("llama", tmp_path)
    for argv, executor in [(("-tp", "2"), "multiproc"), (("-pp", "2"), "multiproc"), (("-tp", "2", "-pp", "2"), "multiproc"),
                           (("-tp", "2", "--distributed-executor-backend", "ray"), "ray")]:
        config = engine_args_from_namespace(parse_serve(*argv, "--kv-offload", "cpu"), model=model).create_engine_config()
        assert config.parallel_config.executor == executor and config.cache_config.kv_offload == ("cpu",), argv


def test_unsupported_tokenizer_mode_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        parse_serve("--tokenizer-mode", "mistral")
    assert "choose from 'auto', 'hf', 'slow'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "logs_requests"),
    [((), True), (("--disable-log-requests",), False), (("--disable-log-requests", "--enable-log-requests"), True)],
)
def test_disable_log_requests_gates_the_request_logger(argv, logs_requests):
    from types import SimpleNamespace

    engine = SimpleNamespace(model_config=SimpleNamespace(served_model_names=("m",), served_model_name="m"))
    ctx = serving_context(parse_serve("--max-log-len", "50", *argv), engine)
    assert (ctx.request_logger is not None) == logs_requests
    if logs_requests:
        assert ctx.request_logger.max_log_len == 50
