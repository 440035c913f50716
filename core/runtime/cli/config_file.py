"""vLLM's ``--config FILE.yaml``: flag values read from a YAML file, under the command line's.

The file is a mapping of flag names (``max-num-seqs`` or ``max_num_seqs``) to values. Each value is
converted and checked by its flag's own type and choices; the results become the subcommand's
defaults, so a flag given on the command line wins wherever it stands.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os

# flags the file may not set: --plugins acts before the command line is parsed, --config would nest
_NOT_IN_FILE = {"plugins": "give --plugins on the command line (plugins load before the file is read)",
                "config": "a config file cannot name another"}


class ConfigFileAction(argparse.Action):
    """Reads the YAML file into the defaults of the (sub)parser the flag belongs to, once per file."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.applied: set[str] = set()

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in self.applied:  # parsed again, the defaults must stay the objects the parse started with
            apply_config_file(parser, values)
            self.applied.add(values)
        setattr(namespace, self.dest, values)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", action=ConfigFileAction, default=None, metavar="FILE.yaml",
        help="YAML file of flag values ({max-num-seqs: 8, model: /path}); flags given on the command line win",
    )


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; with ``--config``, parsed again once the file's values are the defaults,
    so every command-line flag overrides the file whether it comes before or after ``--config``."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    return parser.parse_args(argv)


def load_config_file(path: str) -> dict:
    """The YAML mapping of ``path``; ValueError saying what is wrong with the file."""
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        raise ValueError(f"--config {path}: must be a mapping of flag names to values, such as 'max-num-seqs: 8'")
    return data


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Set ``parser``'s defaults from the file; ValueError naming an unknown key (and close valid ones) or a bad value."""
    options = parser._option_string_actions  # argparse has no public lookup of an action by its flag
    valid = sorted(opt[2:] for opt in options if opt.startswith("--") and opt[2:] not in {*_NOT_IN_FILE, "help"})
    defaults = {}
    for key, value in load_config_file(path).items():
        name = key.strip().replace("_", "-")
        if name in _NOT_IN_FILE:
            raise ValueError(f"--config {path}: key {key!r} is not allowed there: {_NOT_IN_FILE[name]}")
        action = options.get("--" + name)
        if action is None:
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; keys are the long flag names of --help"
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}")
        try:
            converted = _convert(action, "--" + name, value)
        except (argparse.ArgumentError, ValueError) as exc:
            raise ValueError(f"--config {path}: key {key!r}: {exc}") from None
        if converted is not _UNSET:
            defaults[action.dest] = converted
    parser.set_defaults(**defaults)


_UNSET = object()


def _convert(action: argparse.Action, flag: str, value):
    """``value`` as the flag would set it; _UNSET for a null given to a flag that is unset by default."""
    if value is None:
        if action.default is None:
            return _UNSET
        raise ValueError("null is no value for this flag; leave the key out for its default")
    if action.nargs == 0:
        return _switch_value(action, flag, value)
    tokens = _tokens(action, value)
    # A parser of this one flag converts and checks the tokens as the command line would, raising instead of exiting.
    scratch = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    scratch.add_argument(flag, dest="value", type=action.type, nargs=action.nargs, choices=action.choices)
    words = [f"{flag}={tokens[0]}"] if action.nargs is None else [flag, *tokens]  # '=': a value may start with '-'
    converted = scratch.parse_args(words).value
    if action.nargs is None and isinstance(converted, str):
        return tokens[0]  # argparse converts a str default itself, once, where the command line leaves it
    return converted


def _switch_value(action: argparse.Action, flag: str, value):
    """A flag without a value (--x / --no-x, store_true, store_false): true gives it, false its opposite."""
    if not isinstance(value, bool):
        raise ValueError(f"{flag} takes true or false, got {value!r}")
    if isinstance(action, argparse.BooleanOptionalAction):
        return value != flag.startswith("--no-")
    if not isinstance(action.const, bool):
        raise ValueError(f"{flag} is not a setting")
    return action.const if value else not action.const


def _tokens(action: argparse.Action, value) -> list[str]:
    """The command-line words of ``value``: one per list item for a many-valued flag, JSON for an object or a list."""
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_word(item) for item in items]
    return [_word(value)]


def _word(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
