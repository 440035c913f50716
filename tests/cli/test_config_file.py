"""vLLM's ``--config FILE.yaml``: flag values from a YAML file, command-line flags over them, bad keys and values
refused naming the key."""

from __future__ import annotations

import textwrap

import pytest

from runtime.cli import main as cli
from runtime.cli.config_file import parse_args_with_config
from runtime.cli.main import build_parser

CONFIG = """\
model: /models/from-file
max-num-seqs: 8
max_model_len: 512
enable_prefix_caching: false
served_model_name: [a, b]
speculative_config: {method: ngram, num_speculative_tokens: 2}
allowed_origins: ["http://a.example", "http://b.example"]
disable_log_requests: true
enable-request-id-headers: true
cuda_graph_sizes: [1, 2]
port: 9000
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def parse(*argv: str):
    return parse_args_with_config(build_parser(load_plugins=False), ["serve", *argv])


def test_file_values_reach_the_flags(tmp_path):
    args = parse("--config", write(tmp_path, CONFIG))
    assert (args.model_tag, args.model, args.max_num_seqs, args.max_model_len) == (None, "/models/from-file", 8, 512)
    assert args.enable_prefix_caching is False and args.log_requests is False and args.enable_request_id_headers
    assert args.served_model_name == ["a", "b"] and args.cuda_graph_sizes == [1, 2]
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert args.allowed_origins == "http://a.example,http://b.example"  # converted once, as the flag would be
    assert args.port == 9000


def test_command_line_wins_before_or_after_config(tmp_path):
    """A flag equal to its default still wins (8000 is --port's default), wherever it stands."""
    path = write(tmp_path, CONFIG)
    args = parse("/models/positional", "--port", "8000", "--config", path, "--max-num-seqs", "4",
                 "--enable-prefix-caching", "--served-model-name", "c")
    assert args.model_tag == "/models/positional"  # `runtime serve` prefers it to the file's model
    assert (args.port, args.max_num_seqs, args.enable_prefix_caching) == (8000, 4, True)
    assert args.served_model_name == ["c"]
    assert args.max_model_len == 512  # not on the command line: the file's


def test_serve_takes_the_model_from_the_file(tmp_path, monkeypatch):
    import runtime.entrypoints.openai.api_server as api_server

    seen = {}
    monkeypatch.setattr(api_server, "run_server", lambda args, engine_args: seen.setdefault("args", engine_args) and 0)
    assert cli.main(["serve", "--config", write(tmp_path, CONFIG)]) == 0
    assert (seen["args"].model, seen["args"].max_num_seqs) == ("/models/from-file", 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_num_sequences: 3", "unknown key 'max_num_sequences'; did you mean max-num-seqs"),
        ("max-num-seqs: abc", "key 'max-num-seqs': argument --max-num-seqs: invalid int value: 'abc'"),
        ("dtype: float33", "key 'dtype': argument --dtype: invalid choice: 'float33'"),
        ("enable_prefix_caching: 3", "--enable-prefix-caching takes true or false, got 3"),
        ("port: null", "key 'port': null is no value for this flag"),
        ("plugins: cpu", "key 'plugins' is not allowed there: give --plugins on the command line"),
        ("- max-num-seqs", "must be a mapping of flag names to values"),
        ("a: [", "not valid YAML"),
    ],
)
def test_bad_file_is_an_error_naming_the_key(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert cli.main(["serve", "--config", path]) == 2
    error = capsys.readouterr().err
    assert f"runtime: error: --config {path}: " in error and message in error


def test_missing_file(tmp_path, capsys):
    assert cli.main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
