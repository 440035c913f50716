"""On two GPUs: the one-shot all-reduce against NCCL, eagerly and inside replayed CUDA graphs, and a
TP=2 engine whose greedy tokens are those of one GPU, with one-shot on and off.

The all-reduce cases run in two spawned processes (one per GPU, NCCL process group); each rank
checks its results bit for bit: against the rank-order sum of every rank's input (float32
accumulators, rounded once: the kernel's contract), against NCCL (two ranks add two numbers, so
NCCL's sum is the same), and against the other rank's result.
"""

from __future__ import annotations

import gc
import os
import queue
import tempfile
import traceback

import pytest
import torch

from runtime_cuda.collectives import ONE_SHOT_ENV

NUM_GPUS = torch.cuda.device_count()  # NVML: does not start CUDA in the test process
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS < 2, reason=f"needs 2 visible CUDA GPUs, {NUM_GPUS} visible"),
]
WORLD_SIZE = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Message sizes in bytes: one vector, one block's worth, one decode token of an 8B model (8 KiB),
# several blocks, all 36 blocks with runs of several vectors each, up to the benchmark's 8 MiB.
SIZES = (16, 48, 4096, 8 << 10, 8192 + 16, 24 << 10, 64 << 10, 288 << 10, 1 << 20, (3 << 20) + 80, 8 << 20)
TIMEOUT_S = 150


# ---------------------------------------------------------------- two processes
def rank_main(rank: int, init_file: str, case: str, push: bool, results) -> None:
    import torch.distributed as dist

    from runtime_cuda.one_shot import OneShotAllReduce

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
        reduce, reason = OneShotAllReduce.create(dist.group.WORLD, max_bytes=8 << 20, push=push)
        assert reduce is not None, f"no one-shot all-reduce on rank {rank}: {reason}"
        CASES[case](rank, reduce)
        torch.cuda.synchronize()
        reduce.close()
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, traceback.format_exc()))


def run_ranks(case: str, push: bool) -> None:
    """Run ``CASES[case]`` on ranks 0 and 1; fail with each failing rank's traceback, or on a hang."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, os.path.join(tmp, "init"), case, push, results)) for r in range(WORLD_SIZE)]
        for p in procs:
            p.start()
        errors = {}
        try:
            for _ in procs:
                rank, error = results.get(timeout=TIMEOUT_S)
                errors[rank] = error
        except queue.Empty:
            errors["timeout"] = f"ranks {sorted(set(range(WORLD_SIZE)) - set(errors))} did not finish in {TIMEOUT_S} s"
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    failures = {k: v for k, v in errors.items() if v is not None}
    assert not failures, "\n".join(f"== {k}:\n{v}" for k, v in failures.items())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def rank_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` summed in rank order in float32, rounded once to ``x``'s dtype."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(WORLD_SIZE)]
    dist.all_gather(parts, x.contiguous())
    total = parts[0].float()
    for part in parts[1:]:
        total += part.float()
    return total.to(x.dtype)


def check_same_everywhere(out: torch.Tensor, label: str) -> None:
    import torch.distributed as dist

    parts = [torch.empty_like(out) for _ in range(WORLD_SIZE)]
    dist.all_gather(parts, out.contiguous())
    for rank, part in enumerate(parts):
        assert torch.equal(bits(part), bits(out)), f"{label}: rank {rank}'s sum differs"


def check_sum(out: torch.Tensor, x: torch.Tensor, label: str) -> None:
    import torch.distributed as dist

    assert torch.equal(bits(out), bits(rank_order_sum(x))), f"{label}: not the rank-order sum"
    nccl = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(nccl)
    assert torch.equal(bits(out), bits(nccl)), f"{label}: differs from NCCL"
    check_same_everywhere(out, label)


# ---------------------------------------------------------------- cases (run on every rank)
def eager_sizes_and_dtypes(rank: int, reduce) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    for dtype in DTYPES:
        for nbytes in SIZES:
            x = torch.randn(nbytes // torch.empty((), dtype=dtype).element_size(), generator=gen, device="cuda").to(dtype)
            assert reduce.can_reduce(x)
            out = reduce(x.clone())
            check_sum(out, x, f"{dtype} {nbytes} bytes")
    # Views: strided, and 2 bytes past an aligned start, are reduced in a contiguous copy.
    base = torch.randn(8, 512, generator=gen, device="cuda").to(torch.bfloat16)
    strided = base[:, ::2]
    check_sum(reduce(strided), strided, "strided")
    unaligned = base.view(-1)[1:1 + 1024]
    check_sum(reduce(unaligned), unaligned, "unaligned")


def graph_replays(rank: int, reduce) -> None:
    """One graph of one-shot calls of several grids and an NCCL all-reduce, replayed with new
    inputs, with eager calls of other sizes in between (they advance some blocks' epochs only)."""
    import torch.distributed as dist

    gen = torch.Generator(device="cuda").manual_seed(2000 + rank)
    shapes = ((1, 4096), (3, 4096), (64, 4096), (2, 1000))  # 1, 3 and 32 blocks; 2 KiB + 4 KiB...
    inputs = [torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    works = [torch.empty_like(x) for x in inputs]
    nccl_in = torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16)
    nccl_work = torch.empty_like(nccl_in)

    def step() -> None:
        for x, work in zip(inputs, works):
            assert reduce(work.copy_(x)) is work  # in place
        dist.all_reduce(nccl_work.copy_(nccl_in))

    step()  # NCCL's communicator and the kernels exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(40):
        for x in (*inputs, nccl_in):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        for x, work in zip(inputs, works):
            check_sum(work, x, f"replay {replay}, shape {tuple(x.shape)}")
        assert torch.equal(bits(nccl_work), bits(rank_order_sum(nccl_in)))
        if replay % 3 == 0:
            y = torch.randn(5 * 4096 + 8 * (replay + 1), generator=gen, device="cuda").to(torch.bfloat16)
            check_sum(reduce(y.clone()), y, f"eager call after replay {replay}")


def back_to_back_replays(rank: int, reduce) -> None:
    """Hundreds of replays queued without a host synchronization: every one's sum lands."""
    x = torch.arange(16 << 10, device="cuda", dtype=torch.float32) % 97 + rank  # small integers: exact sums
    work, total = torch.empty_like(x), torch.zeros_like(x)
    total.add_(reduce(work.copy_(x)))
    torch.cuda.synchronize()
    total.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total.add_(reduce(work.copy_(x)))
    num_replays = 300
    for _ in range(num_replays):
        graph.replay()
    torch.cuda.synchronize()
    expected = (torch.arange(16 << 10, device="cuda", dtype=torch.float32) % 97) * WORLD_SIZE + sum(range(WORLD_SIZE))
    assert torch.equal(total, expected * num_replays), "a replay's sum is missing or wrong"


CASES = {
    "eager": eager_sizes_and_dtypes,
    "graph": graph_replays,
    "back_to_back": back_to_back_replays,
}


@pytest.mark.parametrize(("case", "push"), [("eager", True), ("eager", False), ("graph", True), ("graph", False),
                                            ("back_to_back", True)])
def test_one_shot_all_reduce_on_two_gpus(case, push):
    """``push``: each rank stores its message in every workspace; else each reads the peers'."""
    run_ranks(case, push)


# ---------------------------------------------------------------- a TP=2 engine
def test_tensor_parallel_engine_greedy_tokens_match_one_gpu(tmp_path, monkeypatch):
    """float32, decode graphs and async scheduling: TP=2 with one-shot (all of this tiny model's
    messages fit it) and with NCCL only gives TP=1's greedy tokens."""
    from runtime import LLM, SamplingParams
    from runtime.testing.models import build_untokenized_model
    from runtime.testing.reference import check_outputs_equal, make_prompts

    path = build_untokenized_model("llama", tmp_path)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    engine = dict(platform="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20,
                  cuda_graph_sizes=[1, 2, 4, 8, 16], async_scheduling=True)

    def tokens(llm) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    single = LLM(path, **engine)
    expected = tokens(single)
    del single
    gc.collect()
    for setting, collectives in (("", "one-shot over CUDA IPC up to"), ("0", f"NCCL only: turned off ({ONE_SHOT_ENV}=0)")):
        monkeypatch.setenv(ONE_SHOT_ENV, setting)  # the workers inherit it; empty: the default
        llm = LLM(path, tensor_parallel_size=2, **engine)
        core = llm.llm_engine.engine_core
        assert type(core.executor).__name__ == "MultiprocExecutor" and core.async_scheduling
        label = f"tp=2 {ONE_SHOT_ENV}={setting!r}"
        check_outputs_equal(expected, tokens(llm), f"{label} vs tp=1")
        for rank, info in enumerate(core.executor.collective_rpc("describe")):
            assert info["collectives"].startswith(collectives), f"{label}: rank {rank} runs {info['collectives']!r}"
            assert info["decode_graph_replays"] > 0, f"{label}: rank {rank} replayed no decode graph"
        core.shutdown()
        del llm, core
        gc.collect()


def test_tensor_parallel_bf16_batch_1_decode_with_fused_prologues(tmp_path):
    """bfloat16 at TP=2, one sequence at a time: every decode step is batch 1, where each rank runs
    the norms inside its projections' gemv and the SiLU as its gate/up gemv stores (rms_norm_gemv, with
    gated for gate/up; tested rank by rank in tests/models/test_models_one_row_fusion.py) under decode graphs. Greedy tokens and
    logprobs stay within bfloat16 rounding of transformers (compared until the first differing token)."""
    from transformers import AutoModelForCausalLM

    from runtime import LLM, SamplingParams
    from runtime.testing.models import build_untokenized_model
    from runtime.testing.reference import check_logprobs_close_until_divergence, hf_greedy, make_prompts

    path = build_untokenized_model("llama", tmp_path)
    prompts = make_prompts()[:3]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # on the CPU: CUDA stays unstarted here
    expected = hf_greedy(hf, prompts, 24)
    del hf
    llm = LLM(path, platform="cuda", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20,
              cuda_graph_sizes=[1, 2, 4], tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5, detokenize=False)
    for prompt, (ref_tokens, ref_steps) in zip(prompts, expected):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        check_logprobs_close_until_divergence(ref_tokens, ref_steps, out.token_ids, out.logprobs, atol=0.1,
                                              label="llama bf16 tp=2 batch 1")
    for rank, info in enumerate(llm.llm_engine.engine_core.executor.collective_rpc("describe")):
        assert info["decode_graph_replays"] > 0, f"rank {rank} replayed no decode graph"
    llm.llm_engine.engine_core.shutdown()
