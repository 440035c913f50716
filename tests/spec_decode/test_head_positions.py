"""EAGLE heads see every position of the target's max_model_len, also past their config's
max_position_embeddings (published EAGLE-3 heads name 2048 for targets of 128k positions): their
rotary table must cover them. It used to hold only the head's own positions, so with a fused rotary
op (GPU platforms read the table by position) a long request read past its end.

The CPU platform is given the reference of the fused op, which indexes the table as the kernel does
(and fails where the kernel would read out of range)."""

from __future__ import annotations

import gc

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.heads import build_eagle1_head, build_eagle3_head, edit_config
from spec_decode.engine_runs import generate, spec_counts

HEAD_POSITIONS = 16
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def fused_rotary(monkeypatch):
    from runtime_cpu.platform import CpuPlatform
    from runtime_kernels.rotary import rotary_embedding_ref

    monkeypatch.setattr(CpuPlatform, "custom_ops", lambda self: {"rotary_embedding": rotary_embedding_ref})


def short_head(method, path) -> str:
    if method == "eagle":
        head = build_eagle1_head(path, UNTOKENIZED_VOCAB_SIZE)
    else:
        head = build_eagle3_head(path, UNTOKENIZED_VOCAB_SIZE, [0, 1, 1], UNTOKENIZED_VOCAB_SIZE // 2)
    return edit_config(head, lambda config: config.update(max_position_embeddings=HEAD_POSITIONS))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_drafts_past_its_own_positions(tmp_path, fused_rotary, method):
    target = build_untokenized_model("llama", tmp_path / "target")
    prompts = [[(7 * i + 3) % UNTOKENIZED_VOCAB_SIZE for i in range(40)], list(range(3, 3 + 2 * HEAD_POSITIONS))]
    baseline = LLM(target, **ENGINE)
    expected = [o.outputs[0].token_ids for o in generate(baseline, prompts, GREEDY)]
    del baseline
    gc.collect()
    llm = LLM(target, **ENGINE,
              speculative_config={"method": method, "model": short_head(method, tmp_path / method), "num_speculative_tokens": 3})
    check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)], method)
    assert spec_counts(llm)[0] > 0, "nothing was drafted"
