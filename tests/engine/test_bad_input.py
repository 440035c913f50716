"""Bad input gets a ValueError naming the field and what is allowed; the engine keeps serving."""

import json

import pytest

from runtime import LLM, SamplingParams

from runtime.testing.models import build_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(path, dtype="float32", max_model_len=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-3), "top_k must be"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop must be non-empty strings"),
    ],
)
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt has 80 tokens, but max_model_len is 64"):
        llm.generate({"prompt_token_ids": [5] * 80}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token id 999999 is out of range"):
        llm.generate({"prompt_token_ids": [5, 999999]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate("hello", SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)
    # of several prompts, the refused one is named by its index (as the server names it)
    with pytest.raises(ValueError, match=r"^prompt\[1\] must not be empty"):
        llm.generate(["hello", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt\[0\] has 80 tokens, but max_model_len is 64"):
        llm.generate([{"prompt_token_ids": [5] * 80}, "hello"], GREEDY, use_tqdm=False)
    # nothing leaked, and the engine still serves
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["hello world", "the sky is"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model")


def test_unknown_architecture(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MadeUpForCausalLM.*LlamaForCausalLM"):
        LLM(path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(max_num_seqs=-1), "max_num_seqs must be a positive integer"),
        (dict(dtype="int3"), "dtype 'int3' is not valid; choose one of: auto, float32"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(attention_backend="flashinfer"), "unknown attention backend 'flashinfer'; installed: .*cpu_paged"),
        (dict(platform="tpu"), "unknown platform 'tpu'; installed: .*cpu"),
        (dict(executor="mpi"), "unknown executor 'mpi'; installed: mp, multiproc, ray, uni, uniproc$"),
        (dict(scheduling_policy="lifo"), "scheduling_policy 'lifo' is not valid; choose one of: fcfs, priority"),
        (dict(max_num_seqz=3), "unknown engine argument.*max_num_seqz"),
        (dict(num_gpu_blocks_override=2, block_size=4, max_model_len=64), "fewer than max_model_len"),
    ],
)
def test_engine_argument_errors(tmp_path_factory, kwargs, match):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("m"))
    with pytest.raises(ValueError, match=match):
        LLM(path, **kwargs)
