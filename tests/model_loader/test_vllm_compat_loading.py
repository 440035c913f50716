"""vLLM's loading options: trust_remote_code, tokenizer_mode, chat_template, generation_config."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from runtime.engine_args import EngineArgs
from runtime.model_loader import get_tokenizer, resolve_model
from runtime.model_loader.generation_defaults import default_sampling_params
from runtime.model_loader.tokenizer import load_chat_template

CUSTOM_CONFIG = '''from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loaded_by_remote_code = True
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from runtime.testing.models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def copy_with(tiny: str, folder, **files: str) -> str:
    path = str(folder / "model")
    shutil.copytree(tiny, path)
    for name, text in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return path


def test_trust_remote_code_lets_transformers_use_the_folders_config_class(tiny, tmp_path):
    path = copy_with(tiny, tmp_path, **{"configuration_custom.py": CUSTOM_CONFIG})
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    with open(config_file, "w") as f:
        json.dump(config, f)
    assert not hasattr(resolve_model(path).hf_config, "loaded_by_remote_code")  # built-in LlamaConfig
    trusted = resolve_model(path, trust_remote_code=True)
    assert trusted.hf_config.loaded_by_remote_code is True
    assert trusted.architecture == "LlamaForCausalLM"  # the model class is still the registered one


def test_tokenizer_mode_and_trust_remote_code_reach_transformers(tiny, monkeypatch):
    from transformers import AutoTokenizer

    calls = []
    real = AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        calls.append(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    get_tokenizer(resolve_model(tiny, tokenizer_mode="slow", trust_remote_code=True))
    get_tokenizer(resolve_model(tiny))
    assert calls == [{"use_fast": False, "trust_remote_code": True}, {"use_fast": True, "trust_remote_code": False}]


def test_unknown_tokenizer_mode_names_the_valid_ones(tiny):
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not valid; choose one of: auto, hf, slow"):
        EngineArgs(model=tiny, tokenizer_mode="mistral").create_engine_config()


def test_chat_template_from_a_file_or_inline_replaces_the_tokenizers(tiny, tmp_path):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(template)
    assert load_chat_template(str(file)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="'no/such/file.jinja' is neither an existing file nor a Jinja template"):
        load_chat_template("no/such/file.jinja")
    tokenizer = get_tokenizer(resolve_model(tiny, chat_template=template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<<hi>>"


GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                     "min_p": 0.01, "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}
EXPECTED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.01, "max_tokens": 5}


def test_generation_config_auto_vllm_and_folder(tiny, tmp_path):
    path = copy_with(tiny, tmp_path, **{"generation_config.json": json.dumps(GENERATION_CONFIG)})
    resolved = resolve_model(path)
    assert default_sampling_params("auto", resolved) == EXPECTED
    assert default_sampling_params("vllm", resolved) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert default_sampling_params(str(other), resolved) == {"temperature": 0.3}
    # the tiny model's own generation_config.json holds token ids only
    assert default_sampling_params("auto", resolve_model(tiny)) == {}
    config = EngineArgs(model=path, generation_config="auto").create_engine_config()
    assert config.model_config.default_sampling_params == EXPECTED


def test_generation_config_that_is_no_folder_names_the_choices(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"generation_config '.*nope' is not a folder holding generation_config.json; "
                                         r"choose one of: auto, vllm, or such a folder"):
        EngineArgs(model=tiny, generation_config=str(tmp_path / "nope")).create_engine_config()
