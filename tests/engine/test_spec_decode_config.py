"""Speculative-decoding flags: vLLM's --speculative-config (JSON) and its short aliases,
checked before the model loads; the metrics under vLLM's names; the latency bench's
mean acceptance length; unsupported proposers refused at start-up."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from runtime.cli.args import engine_args_from_namespace
from runtime.cli.main import build_parser
from runtime.engine_args import EngineArgs, resolve_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def parse_serve(*argv: str) -> EngineArgs:
    args = build_parser(load_plugins=False).parse_args(["serve", "MODEL", *argv])
    return engine_args_from_namespace(args, model=args.model_tag)


def test_cli_takes_vllm_json_and_the_aliases_merge_into_it():
    args = parse_serve("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert args.speculative_config == NGRAM
    assert resolve_speculative_config(args) == NGRAM
    args = parse_serve("--speculative-method", "ngram", "--num-speculative-tokens", "3")
    assert resolve_speculative_config(args) == {"method": "ngram", "num_speculative_tokens": 3}
    args = parse_serve("--speculative-config", '{"prompt_lookup_max": 2}', "--speculative-method", "ngram",
                       "--num-speculative-tokens", "2")
    assert resolve_speculative_config(args) == {"prompt_lookup_max": 2, "method": "ngram", "num_speculative_tokens": 2}
    assert resolve_speculative_config(parse_serve()) is None


def test_cli_rejects_text_that_is_not_a_json_object(capsys):
    for text in ("{method: ngram}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parse_serve("--speculative-config", text)
        assert "--speculative-config" in capsys.readouterr().err


def test_offline_takes_a_dict_or_json_text():
    assert resolve_speculative_config(EngineArgs(model="m", speculative_config=NGRAM)) == NGRAM
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert resolve_speculative_config(EngineArgs(model="m", speculative_config=text)) == {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(speculative_config={"method": "eagle9", "num_speculative_tokens": 2}), r"unknown proposer 'eagle9'; installed: .*ngram"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), r"num_speculative_tokens must be an integer in 1\.\.16, got 0"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 17}), r"integer in 1\.\.16, got 17"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": "4"}), r"integer in 1\.\.16, got '4'"),
        (dict(speculative_config={"method": "ngram"}), r"integer in 1\.\.16, got None"),
        (dict(speculative_method="ngram"), r"integer in 1\.\.16, got None"),
        (dict(num_speculative_tokens=3), r"needs a 'method'"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "model": "x", "draft_tp": 1}),
         r"unknown speculative_config key\(s\) 'draft_tp'; valid keys: method, model, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, num_speculative_tokens=3),
         r"--num-speculative-tokens 3 conflicts with speculative_config's num_speculative_tokens 2"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, speculative_method="lookahead"),
         r"--speculative-method: unknown proposer 'lookahead'"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, speculative_method="medusa"),
         r"--speculative-method 'medusa' conflicts with speculative_config's method 'ngram'; give it once"),
        (dict(speculative_config="{not json"), r"speculative_config must be a JSON object"),
        (dict(speculative_config=[1]), r"speculative_config must be a JSON object \(dict\) or unset"),
    ],
)
def test_bad_speculative_arguments_fail_before_the_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="/no/such/model", **kwargs).create_engine_config()


def test_unknown_method_names_the_installed_proposers_and_the_plugin(plugin_manager, monkeypatch):
    monkeypatch.setenv("RUNTIME_PLUGINS", "")
    from runtime import plugins

    plugins.reset_plugin_manager(plugins.PluginManager(plugins.parse_allow_list("")))
    with pytest.raises(ValueError, match=r"unknown proposer 'ngram'; installed: none \(runtime-plugin-spec-decode provides 'ngram'"):
        EngineArgs(model="/no/such/model", speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()


def test_worker_proposers_without_load_are_refused_at_start_up(plugin_manager, tmp_path):
    """A proposer that needs hidden states runs in the worker and must implement WorkerProposer.load."""
    from runtime import LLM, hookimpl
    from runtime.testing.models import build_untokenized_model

    class HiddenStateProposer:
        needs_hidden_states = True

        def propose(self, batch):
            raise AssertionError("never called")

    class Plugin:
        @staticmethod
        @hookimpl
        def register_proposers(register):
            register("eagle_test", lambda config: HiddenStateProposer())

    plugin_manager.register(Plugin, "eagle_test_plugin")
    path = build_untokenized_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"speculative method 'eagle_test'.*needs_hidden_states.*must implement runtime.spec_decode.WorkerProposer"):
        LLM(path, dtype="float32", skip_tokenizer_init=True,
            speculative_config={"method": "eagle_test", "num_speculative_tokens": 2})


def test_spec_decode_metrics_under_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    from runtime.messages import EngineCoreOutputs
    from runtime.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    base = {"num_running": 1, "num_waiting": 0}
    for drafts, tokens, accepted, per_pos in ((2, 6, 3, [2, 1, 0]), (5, 14, 8, [4, 3, 1])):
        stats = base | {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                        "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos": per_pos}
        metrics.record(EngineCoreOutputs(scheduler_stats=stats))
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("position"))] = sample.value
    for prefix in ("vllm:", "runtime:"):
        assert values[(prefix + "spec_decode_num_drafts_total", None)] == 5
        assert values[(prefix + "spec_decode_num_draft_tokens_total", None)] == 14
        assert values[(prefix + "spec_decode_num_accepted_tokens_total", None)] == 8
        assert [values[(prefix + "spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(3)] == [4, 3, 1]


def test_latency_bench_prints_the_mean_acceptance_length():
    from runtime.bench.step_overhead import tiny_config_folder

    model = tiny_config_folder(hidden=64, layers=2, vocab=512)
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "bench", "latency", "--model", model, "--load-format", "dummy",
         "--dtype", "float32", "--skip-tokenizer-init", "--platform", "cpu", "--input-len", "8", "--output-len", "12",
         "--batch-size", "2", "--num-iters", "1", "--num-iters-warmup", "0",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"runtime: speculative decoding, mean acceptance length (\S+)", result.stdout)
    assert match, result.stdout
    assert match.group(1) == "n/a" or float(match.group(1)) >= 1.0


def test_verification_steps_are_never_routed_into_a_decode_graph():
    """A step with drafts has more tokens than requests: a decode graph (one token per request)
    never runs it; verification graphs (1 + k tokens per request) do, when captured."""
    from runtime.worker.graphs import DecodeGraphs, GraphShape

    graphs = DecodeGraphs((1, 2, 4, 8), None, None, None, None, None, 16, 256)
    assert graphs.shape(3, 3, 1) == GraphShape(4)  # a plain decode step pads to a captured size
    assert graphs.shape(3, 3 + 4, 5) is None  # one request with 4 drafts: no verification graphs captured
    assert graphs.shape(1, 2, 2) is None
    graphs = DecodeGraphs((1, 2, 4, 8), None, None, None, None, None, 16, 256, verify_len=5, max_num_tokens=32)
    assert graphs.verify_sizes == (1, 2, 4)  # 8 x 5 tokens do not fit the step buffers
    assert graphs.shape(3, 3, 1) == GraphShape(4)
    assert graphs.shape(3, 3 + 4, 5) == GraphShape(4, 5)  # requests with fewer drafts keep their own lengths
    assert graphs.shape(3, 3 + 2, 2) == GraphShape(4, 5)
    assert graphs.shape(3, 3 + 5, 6) is None  # more tokens per request than captured (a prefill chunk)
    assert graphs.shape(5, 5 + 4, 5) is None  # more requests than the largest verification graph
