"""An EAGLE head whose checkpoint lacks a tensor, holds one its module has no place for, or holds one of
another shape is refused before any worker starts, naming the tensors as the checkpoint does (q/k/v and
gate/up apart), with one worker and under TP=2 alike. It used to fail as each worker loaded it: "lacks
tensors for ...qkv_proj.weight" (the fused name), and under TP=2 a WorkerDied with a worker traceback."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model

from spec_decode.heads import HIDDEN, INTERMEDIATE, build_eagle1_head, build_eagle3_head

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_untokenized_model("llama", tmp_path_factory.mktemp("head_tensors") / "target")


def edited_eagle1(path, edit) -> str:
    head = build_eagle1_head(path, UNTOKENIZED_VOCAB_SIZE)
    file = os.path.join(head, "pytorch_model.bin")
    tensors = torch.load(file, weights_only=True)
    edit(tensors)
    torch.save(tensors, file)
    return head


def edited_eagle3(path, edit) -> str:
    head = build_eagle3_head(path, UNTOKENIZED_VOCAB_SIZE, [0, 1, 1], UNTOKENIZED_VOCAB_SIZE // 2)
    file = os.path.join(head, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return head


def drop(*names):
    def edit(tensors):
        for name in names:
            del tensors[name]
    return edit


def add(name, shape):
    def edit(tensors):
        tensors[name] = torch.zeros(shape)
    return edit


BAD_HEADS = {  # method, checkpoint edit, the error expected
    "eagle1_missing_k": ("eagle", drop("layers.0.self_attn.k_proj.weight"),
                         r"missing tensors layers\.0\.self_attn\.k_proj\.weight$"),
    "eagle1_missing_mlp": ("eagle", drop("layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"),
                           r"missing tensors layers\.0\.mlp\.down_proj\.weight, layers\.0\.mlp\.up_proj\.weight$"),
    # EAGLE-1's first layer has no input norm: the loader has nowhere to put one
    "eagle1_extra": ("eagle", add("layers.0.input_layernorm.weight", (HIDDEN,)),
                     r"unexpected tensors layers\.0\.input_layernorm\.weight$"),
    "eagle1_wrong_shape": ("eagle", add("layers.0.mlp.gate_proj.weight", (INTERMEDIATE // 2, HIDDEN)),
                           rf"tensors of the wrong shape layers\.0\.mlp\.gate_proj\.weight \[{INTERMEDIATE // 2}, "
                           rf"{HIDDEN}\] \(expected \[{INTERMEDIATE}, {HIDDEN}\]\)$"),
    "eagle3_missing_norm": ("eagle3", drop("norm.weight", "midlayer.hidden_norm.weight"),
                            r"missing tensors midlayer\.hidden_norm\.weight, norm\.weight$"),
    "eagle3_wrong_q": ("eagle3", add("midlayer.self_attn.q_proj.weight", (64, HIDDEN)),
                       rf"tensors of the wrong shape midlayer\.self_attn\.q_proj\.weight \[64, {HIDDEN}\] "
                       rf"\(expected \[64, {2 * HIDDEN}\]\)$"),
    "eagle3_wrong_d2t": ("eagle3", add("d2t", (3,)),
                         rf"tensors of the wrong shape d2t \[3\] \(expected \[{UNTOKENIZED_VOCAB_SIZE // 2}\]\)$"),
    "eagle3_several": ("eagle3", lambda t: (drop("midlayer.self_attn.v_proj.weight")(t), add("extra.bias", (2,))(t)),
                       r"missing tensors midlayer\.self_attn\.v_proj\.weight; unexpected tensors extra\.bias$"),
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_head_tensors_checked_before_workers_start(target, tmp_path, case, tp):
    method, edit, problems = BAD_HEADS[case]
    head = (edited_eagle1 if method == "eagle" else edited_eagle3)(tmp_path / case, edit)
    with pytest.raises(ValueError, match=rf"^{method} head '{head}' does not match its config\.json: {problems}"):
        LLM(target, tensor_parallel_size=tp, **ENGINE,
            speculative_config={"method": method, "model": head, "num_speculative_tokens": 2})


def test_head_with_tensors_the_loader_skips_still_runs(target, tmp_path):
    """SafeAILab's EAGLE-1 checkpoints carry ``rotary_emb.inv_freq``, some heads KV cache scales: the loader
    takes or skips them, so the check must let them through."""
    edits = (add("layers.0.self_attn.rotary_emb.inv_freq", (8,)), add("layers.0.self_attn.k_scale", ()),
             add("layers.0.self_attn.v_scale", ()))

    def edit(tensors):
        for e in edits:
            e(tensors)
        tensors["layers.0.self_attn.k_scale"] += 1
        tensors["layers.0.self_attn.v_scale"] += 1

    head = edited_eagle1(tmp_path / "skipped", edit)
    llm = LLM(target, **ENGINE, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
