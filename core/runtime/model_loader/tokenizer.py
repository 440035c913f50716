"""Load the tokenizer of a resolved model (a folder, or the vocabulary inside a GGUF)."""

from __future__ import annotations

import copy
import os

from runtime.model_loader.gguf_reader import cached_per_file
from runtime.model_loader.resolve import ResolvedModel

# vLLM's tokenizer modes that apply to transformers tokenizers ("mistral" and "custom" need
# tokenizer packages this runtime does not use).
TOKENIZER_MODES = ("auto", "hf", "slow")


def get_tokenizer(resolved: ResolvedModel):
    """A transformers ``PreTrainedTokenizerBase`` for ``resolved.tokenizer_path``.

    ``resolved.tokenizer_mode`` "slow" asks transformers for the Python tokenizer;
    ``resolved.chat_template`` replaces the tokenizer's own template. Converting a GGUF
    vocabulary takes seconds (tens for large vocabularies), so that conversion happens once
    per process; each call gets its own copy.
    """
    path = resolved.tokenizer_path
    try:
        if path.endswith(".gguf"):
            tokenizer = copy.deepcopy(_gguf_tokenizer(path))
        else:
            tokenizer = _folder_tokenizer(path, resolved.tokenizer_mode, resolved.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r}: {exc}; pass a folder with tokenizer files "
            "or a .gguf file as the tokenizer"
        ) from exc
    if resolved.chat_template is not None:
        tokenizer.chat_template = resolved.chat_template
    return tokenizer


def _folder_tokenizer(path: str, mode: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {mode!r} is not supported; choose one of: {', '.join(TOKENIZER_MODES)}")
    return AutoTokenizer.from_pretrained(path, use_fast=mode != "slow", trust_remote_code=trust_remote_code)


@cached_per_file(maxsize=2)
def _gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    from runtime.model_loader.gguf_reader import gguf_reader, shared_gguf_readers

    if "tokenizer.ggml.tokens" not in gguf_reader(path).fields:
        raise ValueError("the GGUF file holds no vocabulary (no tokenizer.ggml.tokens key)")
    with shared_gguf_readers():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (as vLLM's ``--chat-template``)."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(
        f"chat_template {value!r} is neither an existing file nor a Jinja template; "
        "pass the path of a template file or the template text"
    )
