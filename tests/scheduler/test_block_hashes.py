"""Prefix-cache block hashes: stable across processes, isolated by cache_salt, hashed once per block."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from runtime import LLM, SamplingParams
from runtime.messages import ModelRunnerOutput
from runtime.scheduler import kv_cache_manager as kv_module
from runtime.scheduler.block_hash import ROOT_HASH, first_block_extra_keys, hash_block
from runtime.scheduler.kv_cache_manager import KVCacheManager

PROMPT = list(range(1, 41))  # 40 tokens: 10 blocks of 4, 2 blocks of 16

# Prints the block hashes of PROMPT (16-token blocks) without a salt and with one, as hex.
_HASHES_SCRIPT = """
import json, sys
from runtime.sampling_params import SamplingParams
from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.scheduler.request import Request

prompt = json.loads(sys.argv[1])
kv = KVCacheManager(num_blocks=1, block_size=16, enable_caching=True)
result = {}
for salt in (None, "tenant-a"):
    request = Request("r", prompt, SamplingParams(cache_salt=salt))
    kv._update_block_hashes(request)
    result[str(salt)] = [h.hex() for h in request.block_hashes]
print(json.dumps(result))
"""


def hashes_in_subprocess(python_hash_seed: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": python_hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _HASHES_SCRIPT, json.dumps(PROMPT)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_block_hashes_equal_across_processes():
    """Two fresh interpreters with different str-hash seeds (what Python's hash() depended on)
    compute the same digests, and so does this process."""
    first, second = hashes_in_subprocess("1"), hashes_in_subprocess("2")
    assert first == second
    assert len(first["None"]) == 2 and first["None"] != first["tenant-a"]
    chained = hash_block(hash_block(None, PROMPT[:16]), PROMPT[16:32])
    assert first["None"] == [hash_block(None, PROMPT[:16]).hex(), chained.hex()]


def test_block_hash_is_the_documented_encoding_and_pinned():
    """sha256 over parent digest | uint32 count | int32 ids | (uint32 length | UTF-8) per extra key.

    The pinned digest is the same after a restart or an upgrade; changing the encoding on
    purpose means a new ROOT_HASH version and a new pinned value here.
    """
    tokens = list(range(1, 17))
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<I16i", 16, *tokens)).digest()
    assert hash_block(None, tokens) == expected
    assert expected.hex() == "e5d0909aaa1a9e7d91dfaf680ed6e5d4961748aa896b573f28b293ca539b0e82"
    key = b"cache_salt:tenant-a"
    salted = hashlib.sha256(ROOT_HASH + struct.pack("<I16i", 16, *tokens) + struct.pack("<I", len(key)) + key)
    assert hash_block(None, tokens, first_block_extra_keys("tenant-a")) == salted.digest()


def test_block_hash_covers_parent_tokens_and_extra_keys():
    tokens = [7] * 16
    base = hash_block(None, tokens)
    assert isinstance(base, bytes) and len(base) == 32
    variants = [
        hash_block(base, tokens),  # another parent
        hash_block(None, [7] * 15 + [8]),  # another token
        hash_block(None, [7] * 15),  # fewer tokens
        hash_block(None, tokens, ("a",)),  # an extra key
        hash_block(None, tokens, ("a", "b")),
        hash_block(None, tokens, ("ab",)),  # extra keys are length-prefixed: ("ab",) != ("a", "b")
        hash_block(None, [-1] * 16),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert first_block_extra_keys(None) == ()


def test_salt_changes_every_block_hash_through_the_chain(make_request):
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    plain, salted = make_request("a", PROMPT), make_request("b", PROMPT, cache_salt="x")
    kv._update_block_hashes(plain)
    kv._update_block_hashes(salted)
    assert len(plain.block_hashes) == len(salted.block_hashes) == 10
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    # only the first block hashes the salt; the rest chain on it
    assert salted.block_hashes[0] == hash_block(None, PROMPT[:4], ("cache_salt:x",))
    assert salted.block_hashes[1] == hash_block(salted.block_hashes[0], PROMPT[4:8])


@pytest.mark.parametrize(
    ("first_salt", "second_salt", "expected_hit"),
    [("tenant-a", "tenant-b", 0), ("tenant-a", None, 0), (None, "tenant-a", 0), ("tenant-a", "tenant-a", 36), (None, None, 36)],
)
def test_cache_salt_isolates_prefix_hits(make_request, first_salt, second_salt, expected_hit):
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    first = make_request("a", PROMPT, cache_salt=first_salt)
    assert kv.allocate_slots(first, len(PROMPT)) is not None
    second = make_request("b", PROMPT, cache_salt=second_salt)
    blocks, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == expected_hit  # 9 of 10 blocks: the last token is always recomputed
    assert len(blocks) == expected_hit // 4


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_cache_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match=r"cache_salt must be None or a non-empty string, got"):
        SamplingParams(cache_salt=salt)


def test_decode_hashes_each_block_once(make_scheduler, make_request, monkeypatch):
    """Decode steps hash nothing until a block fills; then that one block, once."""
    calls = []

    def counted(parent, token_ids, extra_keys=()):
        calls.append(tuple(token_ids))
        return hash_block(parent, token_ids, extra_keys)

    monkeypatch.setattr(kv_module, "hash_block", counted)
    scheduler = make_scheduler(num_blocks=32, block_size=4, caching=True)
    request = make_request("a", 10, max_tokens=30, ignore_eos=True, cache_salt="s")
    scheduler.add_request(request)
    num_steps = 0
    while scheduler.has_requests():
        output = scheduler.schedule()
        sampled = [r for r in output.num_scheduled_tokens if scheduler.requests[r].num_output_placeholders]
        scheduler.update_from_output(output, ModelRunnerOutput(sampled, [[3] for _ in sampled]))
        num_steps += 1
    assert num_steps == 30 and request.num_tokens == 40
    # 9 full blocks of computed tokens (the 40th token is sampled, never computed), each hashed once
    assert len(calls) == len(request.block_hashes) == 9
    assert calls == [tuple(request.all_token_ids[i : i + 4]) for i in range(0, 36, 4)]


# ----------------------------------------------------------------- end to end, offline LLM
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from runtime.testing.models import build_untokenized_model

    path = build_untokenized_model("llama", tmp_path_factory.mktemp("salt-llama"))
    return LLM(path, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=True, block_size=4,
               max_model_len=128, num_gpu_blocks_override=64)


def generate(llm: LLM, prompt: dict, params: SamplingParams):
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return output.num_cached_tokens, output.outputs[0].token_ids


def test_llm_cache_salt_isolates_tenants(llm):
    prompt = [10 + i for i in range(30)]  # 7 full blocks of 4 can be reused (the last token never is)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain, salted_a, salted_b = SamplingParams(**greedy), SamplingParams(**greedy, cache_salt="a"), SamplingParams(**greedy, cache_salt="b")
    assert llm.llm_engine.engine_core.reset_prefix_cache()
    cached_a, tokens_a = generate(llm, {"prompt_token_ids": prompt}, salted_a)
    cached_b, tokens_b = generate(llm, {"prompt_token_ids": prompt, "cache_salt": "b"}, plain)  # vLLM's prompt-dict field
    cached_none, tokens_none = generate(llm, {"prompt_token_ids": prompt}, plain)
    cached_a2, tokens_a2 = generate(llm, {"prompt_token_ids": prompt, "cache_salt": "a"}, plain)
    cached_b2, _ = generate(llm, {"prompt_token_ids": prompt}, salted_b)
    cached_none2, _ = generate(llm, {"prompt_token_ids": prompt}, plain)
    assert (cached_a, cached_b, cached_none) == (0, 0, 0)
    assert cached_a2 == cached_b2 == cached_none2 == 28
    assert tokens_a == tokens_b == tokens_none == tokens_a2  # the salt changes sharing, never the output


def test_llm_rejects_bad_or_conflicting_prompt_salt(llm):
    prompt = [10, 11, 12]
    with pytest.raises(ValueError, match="cache_salt must be None or a non-empty string, got ''"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"cache_salt differs between the prompt dict \('a'\) and SamplingParams \('b'\)"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], SamplingParams(cache_salt="b"), use_tqdm=False)
