"""vLLM's --revision / --code-revision / --tokenizer-revision on local paths, and --task / --runner."""

from __future__ import annotations

import logging
import os

import pytest

from runtime.cli.args import engine_args_from_namespace
from runtime.cli.main import build_parser
from runtime.engine_args import EngineArgs

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def parse_serve(*argv: str):
    return build_parser(load_plugins=False).parse_args(["serve", "MODEL", *argv])


@pytest.fixture(scope="module")
def cache_repo(tmp_path_factory):
    """A Hugging Face cache repo folder: snapshots COMMIT (the model) and OTHER; refs main -> OTHER, v1 -> COMMIT."""
    from runtime.testing.models import build_untokenized_model

    repo = tmp_path_factory.mktemp("hub") / "models--org--tiny"
    build_untokenized_model("llama", repo / "snapshots" / COMMIT)
    (repo / "snapshots" / OTHER).mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OTHER)
    (repo / "refs" / "v1").write_text(COMMIT)
    return repo


def test_flags_reach_the_engine_arguments():
    args = engine_args_from_namespace(parse_serve(
        "--revision", "v1", "--code-revision", "abc1234", "--tokenizer-revision", "main", "--task", "generate",
        "--runner", "generate",
    ))
    assert (args.revision, args.code_revision, args.tokenizer_revision) == ("v1", "abc1234", "main")
    assert (args.task, args.runner) == ("generate", "generate")
    defaults = engine_args_from_namespace(parse_serve())
    assert (defaults.revision, defaults.task, defaults.runner) == (None, "auto", "auto")


@pytest.mark.parametrize("revision", ["v1", COMMIT, COMMIT[:8]])
def test_revision_naming_the_cache_snapshot_is_accepted(cache_repo, revision):
    model = str(cache_repo / "snapshots" / COMMIT)
    config = EngineArgs(model=model, revision=revision, tokenizer_revision=revision).create_engine_config()
    assert config.model_config.model == model


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"revision": "main"}, f"revision 'main' does not match .*{COMMIT}; its snapshot is .*{OTHER}"),
        ({"code_revision": OTHER[:10]}, f"code_revision '{OTHER[:10]}' does not match .*; its snapshot is"),
        ({"tokenizer_revision": "v2"}, "tokenizer_revision 'v2' does not match .*the cache holds no snapshot of it"),
        ({"revision": f"../snapshots/{COMMIT}"}, "the cache holds no snapshot of it"),  # no path tricks
    ],
)
def test_revision_of_another_snapshot_is_an_error(cache_repo, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(cache_repo / "snapshots" / COMMIT), **kwargs).create_engine_config()


def test_revision_on_a_plain_folder_warns_and_loads(cache_repo, tmp_path, caplog):
    """transformers ignores revision= on a local folder; here the folder is used as well, but with a warning."""
    plain = tmp_path / "plain-folder"
    os.symlink(cache_repo / "snapshots" / COMMIT, plain)
    with caplog.at_level(logging.WARNING, logger="runtime.model_revision"):
        EngineArgs(model=str(plain), revision="main").create_engine_config()
    assert f"revision 'main' is not checked: {plain} is a local folder that records no revision" in caplog.text


@pytest.mark.parametrize(("name", "value"), [("task", "embed"), ("task", "classify"), ("runner", "pooling"),
                                             ("runner", "draft")])
def test_non_generation_task_is_an_error(name, value):
    """Refused before the model is read (MODEL does not exist)."""
    args = engine_args_from_namespace(parse_serve(f"--{name}", value))
    with pytest.raises(ValueError, match=f"{name} '{value}' is not supported: .* supported: auto, generate"):
        args.create_engine_config()
