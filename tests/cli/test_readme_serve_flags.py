"""The README's table of vLLM flags documents real ``runtime serve`` flags, this session's among them."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def serve_options() -> set[str]:
    parser = build_parser(load_plugins=False)
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


def vllm_flag_table() -> str:
    text = README.read_text(encoding="utf-8")
    section = re.split(r"\n##", text.split("### Coming from vLLM", 1)[1], maxsplit=1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `"))


def test_every_flag_of_the_vllm_table_is_a_serve_flag():
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", vllm_flag_table()))
    assert named and not named - serve_options(), sorted(named - serve_options())


def test_the_vllm_table_documents_the_newer_serve_flags():
    table = vllm_flag_table()
    flags = ["--config", "--revision", "--code-revision", "--tokenizer-revision", "--task", "--runner",
             "--reasoning-parser", "--response-role", "--enable-sleep-mode", "--enable-request-id-headers"]
    assert set(flags) <= serve_options()
    assert [flag for flag in flags if f"`{flag}" not in table] == []
