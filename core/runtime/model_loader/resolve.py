"""Find a model's config, weights format, architecture and tokenizer from a local path.

Accepted: a Hugging Face folder (``config.json`` + safetensors), a ``.gguf`` file, or a
folder holding exactly one ``.gguf`` file. There is no hub download.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any

from runtime.model_loader.gguf_reader import cached_per_file

SUPPORTED_SOURCES = "local Hugging Face folders (with config.json) and .gguf files are supported"


@dataclass(slots=True)
class ResolvedModel:
    """Everything the loader needs to know about a model before reading weights."""

    path: str  # the model folder (for GGUF: the folder holding the file)
    hf_config: Any  # transformers config of the text model
    gguf_file: str | None  # absolute path of the .gguf file, None for a Hugging Face folder
    architecture: str  # a name registered through ``register_models``
    tokenizer_path: str  # folder or .gguf file the tokenizer is read from
    generation_config: Any = None  # transformers GenerationConfig when generation_config.json exists
    trust_remote_code: bool = False  # let transformers run the folder's own config/tokenizer code (auto_map)
    tokenizer_mode: str = "auto"  # "auto"/"hf": the fast tokenizer when there is one; "slow": the Python one
    chat_template: str | None = None  # replaces the tokenizer's chat template when set
    # runtime.quantization.QuantConfig the linear layers are built through (None: unquantized);
    # set by the engine from --quantization or the checkpoint's quantization_config
    quant_config: Any = None


def resolve_model(
    model: str,
    tokenizer: str | None = None,
    *,
    trust_remote_code: bool = False,
    tokenizer_mode: str = "auto",
    chat_template: str | None = None,
) -> ResolvedModel:
    """Resolve ``model`` (a folder or a ``.gguf`` file) and an optional separate tokenizer.

    ``trust_remote_code`` lets transformers import the Python files a folder's ``auto_map``
    names (custom config and tokenizer classes); the model class itself is always one
    registered through ``register_models``.
    """
    path = _existing_path(model, "model")
    gguf_file = _find_gguf(path)
    folder = os.path.dirname(gguf_file) if gguf_file else path
    hf_config = _gguf_config(gguf_file) if gguf_file else _folder_config(folder, trust_remote_code)
    return ResolvedModel(
        path=folder,
        hf_config=hf_config,
        gguf_file=gguf_file,
        architecture=model_architecture(hf_config),
        tokenizer_path=_existing_path(tokenizer, "tokenizer") if tokenizer else (gguf_file or folder),
        generation_config=read_generation_config(folder),
        trust_remote_code=trust_remote_code,
        tokenizer_mode=tokenizer_mode,
        chat_template=chat_template,
    )


def _existing_path(value: str, what: str) -> str:
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.exists(path):
        raise ValueError(f"{what} path {value!r} does not exist; {SUPPORTED_SOURCES} (no hub downloads)")
    return path


def _find_gguf(path: str) -> str | None:
    """The GGUF file ``path`` names or holds, or None for a Hugging Face folder."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; {SUPPORTED_SOURCES}")
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(os.path.basename(f) for f in found)
        raise ValueError(f"folder {path!r} holds several .gguf files ({names}); pass the path of one of them")
    raise ValueError(f"folder {path!r} has no config.json and no .gguf file; {SUPPORTED_SOURCES}")


def _folder_config(folder: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"could not read {os.path.join(folder, 'config.json')}: {exc}") from exc


def _gguf_config(gguf_file: str):
    return copy.deepcopy(_cached_gguf_config(gguf_file))


@cached_per_file(maxsize=4)
def _cached_gguf_config(gguf_file: str):
    """Parsing a GGUF header is slow (it holds the whole vocabulary); do it once per process."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' config: a metadata value of the wrong type
    from transformers import AutoConfig

    from runtime.model_loader.gguf_config import apply_gguf_metadata
    from runtime.model_loader.gguf_reader import shared_gguf_readers, unstated_vocab_size

    try:
        # Without the vocabulary (slow to convert); its size is taken from the array's length where the
        # metadata has no vocab_size, as transformers would (it warns of a default otherwise: quiet here).
        with shared_gguf_readers(header_only=True), _quiet("transformers.modeling_gguf_pytorch_utils"):
            config = AutoConfig.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
        # A GGUF of a multimodal model (Gemma 3) carries only the language model.
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        size = unstated_vocab_size(gguf_file)
        if size is not None:
            config.vocab_size = size
        return apply_gguf_metadata(config, gguf_file)
    except (ValueError, KeyError, OSError, struct.error, StrictDataclassError) as exc:  # struct.error: a file cut short
        raise ValueError(f"could not read the config of GGUF file {gguf_file!r}: {exc}") from exc


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Warnings of ``logger_name`` (transformers' logging) silenced while inside."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_architecture(hf_config) -> str:
    """The registered architecture for a config: its ``architectures``, else its ``model_type``."""
    from runtime.plugins import get_registry

    registry = get_registry("model")
    declared = list(getattr(hf_config, "architectures", None) or [])
    for name in declared:
        if name in registry:
            return name
    if not declared:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        derived = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
        if derived in registry:
            return derived
    found = ", ".join(declared) if declared else f"model_type {getattr(hf_config, 'model_type', None)!r}"
    raise ValueError(
        f"unsupported model architecture {found}; supported: {', '.join(sorted(registry.names()))} "
        "(a plugin can add more through register_models)"
    )


def read_generation_config(folder: str):
    """The transformers GenerationConfig of ``folder``, or None when it has no generation_config.json."""
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder)
