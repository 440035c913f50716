"""transformers' own reading of a real GGUF file, the reference of several test files, read once a run.

Dequantizing a file in transformers takes 10-20 s (Gemma 3's 262k-token vocabulary is slow to parse), and
three test files compare against the same two files. The first reader saves the float32 tensors and the
config under the run's temporary root, which every xdist worker of the run shares (a file lock lets one
write while the others wait); the others build the model from them in a second or two.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch


def transformers_gguf_model(path: str, shared_root: Path, config=None) -> torch.nn.Module:
    """transformers' model of the GGUF file at ``path`` (float32, eval mode), built from ``config`` when
    given (a config of the same file, e.g. the engine's), else from transformers' own config of it."""
    import transformers
    from filelock import FileLock
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.model_loader.gguf_reader import shared_gguf_readers

    folder = shared_root / "transformers_gguf" / f"{os.path.basename(path)}-{os.path.getsize(path)}-{transformers.__version__}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (folder / "model.safetensors").exists():
            directory, name = os.path.split(path)
            with shared_gguf_readers():  # the file parsed once in this process
                model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
            partial = folder.with_name(folder.name + ".partial")
            partial.mkdir(exist_ok=True)
            model.config.to_json_file(str(partial / "config.json"))
            seen, tensors = set(), {}
            for key, tensor in model.state_dict().items():  # a tied head is saved once, as the embedding
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    tensors[key] = tensor.contiguous()
            save_file(tensors, str(partial / "model.safetensors"))
            os.rename(partial, folder)
    if config is None:
        config = AutoConfig.from_pretrained(str(folder))
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):  # transformers' marker of a GGUF-read model: nothing to apply here
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:
        assert config.tie_word_embeddings, "lm_head.weight is missing and the head is not tied"
        model.tie_weights()
    return model.eval()
