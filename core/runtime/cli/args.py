"""CLI flags generated from the EngineArgs fields, so both stay in step."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing

from runtime.cli.config_file import add_config_arg
from runtime.engine_args import EngineArgs


def _base_type(annotation):
    if isinstance(annotation, str):
        names = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict, "None": None}
        annotation = eval(annotation, names)  # noqa: S307
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def _json_value(text: str, kind: type, shape: str, unreadable: str = "not valid JSON"):
    """``text`` parsed as JSON of ``kind``; an ArgumentTypeError (``unreadable``, or naming ``shape``) otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{unreadable} ({exc}): {text!r}") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"must be {shape}, got {text!r}")
    return value


def json_object(text: str) -> dict:
    """A dict-valued flag's value: JSON text of an object (vLLM's ``--speculative-config '{...}'``)."""
    return _json_value(text, dict, "a JSON object ({...})")


def json_or_comma_list(text: str) -> list:
    """A list-valued flag's value: vLLM's JSON list (``'["a", "b"]'``) or comma-separated text."""
    if not text.lstrip().startswith("["):
        return [item.strip() for item in text.split(",")]
    return _json_value(text, list, "a JSON list ([...]) or comma-separated", "not a valid JSON list")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    add_config_arg(parser)
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = [flag, *f.metadata.get("aliases", ())]
        kind = _base_type(f.type)
        help_text = f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kwargs = {"dest": f.name, "default": f.default, "type": kind, "help": help_text}
        if typing.get_origin(kind) is list:  # a list flag takes one or more values
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        elif kind is dict:  # a dict flag takes JSON text
            kwargs.update(type=json_object, metavar="JSON")
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("kind"):
            kwargs["metavar"] = f.metadata["kind"].upper()
        group.add_argument(*flags, **kwargs)


def engine_args_from_namespace(ns: argparse.Namespace, **overrides) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    values.update(overrides)
    return EngineArgs(**values)
