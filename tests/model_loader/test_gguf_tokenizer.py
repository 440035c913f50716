"""The tokenizer of a GGUF file, as the engine gets it, against transformers' own GGUF tokenizer.

SmolLM2's file (byte-level BPE, its "smollm" pre-tokenizer, no BOS, a chat template) and a tiny
Gemma-style sentencepiece vocabulary (byte fallback, BOS added, no space prefix): the same ids for
tricky strings, special tokens in the text kept whole, the file's chat template. A model file without
a vocabulary runs with ``tokenizer=`` (``--tokenizer``) given separately, a .gguf file or a folder.
"""

from __future__ import annotations

import os

import pytest
from support.gguf_files import spm_vocabulary, tiny_config, write_gguf

from runtime.engine_arg_values import eos_token_ids
from runtime.model_loader import get_tokenizer, resolve_model
from runtime.testing.models import smollm2_gguf_path, smollm2_tokenizer

TRICKY = [
    "Hello world", "  leading spaces", " one leading space", "trailing  ", "héllo wörld ñ 日本語 한국어",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 🇫🇷", "tab\tnew\nline\r\n\n", "1234567 3.14159 1,000", "don't WE'LL x's",
    "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<start_of_turn>x<end_of_turn>", "\x00\x01\u00ad\u200b",
]


def spm_files(folder) -> tuple[str, str]:
    """(a tiny gemma3 model file with no vocabulary, a file of the same shape with the vocabulary)."""
    config = tiny_config("gemma3", num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                         hidden_size=64, intermediate_size=64, head_dim=32, bos_token_id=2, eos_token_id=1)
    model = write_gguf(folder / "model" / "model.gguf", "gemma3", config=config)
    return model, write_gguf(folder / "tokenizer" / "tokenizer.gguf", "gemma3", config=config, extra=spm_vocabulary)


def transformers_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def check_same_ids(ours, reference, texts) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids)


def test_smollm2_tokenizer_is_transformers_gguf_tokenizer():
    from runtime.model_loader.gguf_reader import gguf_reader

    path = smollm2_gguf_path()
    resolved = resolve_model(path)
    ours = get_tokenizer(resolved)
    check_same_ids(ours, smollm2_tokenizer(), TRICKY)
    assert ours.encode("Hello world") == [19556, 905]  # tokenizer.ggml.add_bos_token is false
    assert ours.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [1, 4093, 2]  # kept whole
    assert ours.encode("1234567", add_special_tokens=False) == [33, 34, 35, 36, 37, 38, 39]  # one digit each
    assert ours.chat_template == gguf_reader(path).fields["tokenizer.chat_template"].contents()
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert eos_token_ids(resolved) == (2, 0)  # <|im_end|>, then <|endoftext|>, where llama.cpp stops too


def test_sentencepiece_vocabulary_with_byte_fallback(tmp_path):
    _, vocabulary = spm_files(tmp_path)
    ours = get_tokenizer(resolve_model(vocabulary))
    check_same_ids(ours, transformers_tokenizer(vocabulary), TRICKY)
    assert ours.convert_ids_to_tokens(ours.encode("hello world")) == ["<bos>", "hello", "▁world"]  # BOS, no prefix
    emoji = ours.encode("😀", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(emoji) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"] and ours.decode(emoji) == "😀"
    chat = ours.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert ours.encode(chat, add_special_tokens=False)[:2] == [2, 4]  # <bos> <start_of_turn>, each once


def test_a_model_file_without_vocabulary_takes_a_separate_tokenizer(tmp_path):
    from runtime import LLM, SamplingParams

    model, vocabulary = spm_files(tmp_path)
    with pytest.raises(ValueError, match=r"could not load a tokenizer from '.*model\.gguf': the GGUF file holds no "
                       r"vocabulary \(no tokenizer\.ggml\.tokens key\); pass a folder with tokenizer files or a \.gguf"):
        get_tokenizer(resolve_model(model))
    from runtime.cli.args import engine_args_from_namespace
    from runtime.cli.main import build_parser
    from runtime.engine_args import build_model_config
    from runtime_cpu.platform import CpuPlatform

    namespace = build_parser().parse_args(["serve", model, "--tokenizer", vocabulary, "--max-model-len", "64"])
    config = build_model_config(engine_args_from_namespace(namespace, model=namespace.model_tag), CpuPlatform())
    assert config.gguf_file == model and config.tokenizer == vocabulary
    folder = str(tmp_path / "saved")
    transformers_tokenizer(vocabulary).save_pretrained(folder)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for tokenizer in (vocabulary, folder):
        llm = LLM(model, tokenizer=tokenizer, dtype="float32", max_model_len=64, enforce_eager=True)
        output = llm.generate(["hello world"], params)[0]
        assert output.prompt_token_ids == [2, 276, 278] and len(output.outputs[0].token_ids) == 2
        assert llm.get_tokenizer().chat_template.startswith("{{ bos_token }}")
