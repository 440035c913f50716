"""The CUDA 4-bit GEMV for 1-4 rows (runtime_quant.w4a16_cuda) against the float32 reference.

GPU only: the kernel is CUDA C compiled by NVRTC. Shapes cover one and several 128-row chunks
per block, blocks along K (the partial sums and the last block's ordered sum), N not a multiple
of the 128-column block, groups of 128 and 256 rows and one group, bias, both 16-bit dtypes,
activations far outside half's range (the power-of-two scaling), CUDA-graph replays (the
counters reset themselves), the routing of one-row calls through the Triton entry point, and
the prologues (SiLU-and-mul, RMSNorm) against the separate ops.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from test_wna16_kernels import make_layer
from runtime_quant.wna16_kernels import dequant_matmul

pytestmark = pytest.mark.gpu


def _reference(layer, scheme, x, bias):
    return dequant_matmul(layer, scheme, x.float(), None if bias is None else bias.float())


@pytest.fixture(autouse=True)
def _kernel_compiles():
    if not torch.cuda.is_available():
        pytest.fail("a gpu test ran without a GPU")
    from runtime_quant import w4a16_cuda

    for v in w4a16_cuda.VARIANTS:
        assert w4a16_cuda.kernels(torch.cuda.current_device(), v.columns, v.min_blocks) is not None, f"{v} did not compile"
    v = w4a16_cuda.MULTI_ROW
    for rows in range(2, w4a16_cuda.KERNEL_MAX_ROWS + 1):
        assert w4a16_cuda.kernels(torch.cuda.current_device(), v.columns, v.min_blocks, rows) is not None, f"{rows} rows"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,group,chunks", [
    (128, 72, 128, 8),      # one chunk, one block along K, a partial column block
    (1024, 200, 128, 8),    # 8 chunks: one per warp
    (1024, 200, 128, 3),    # 3 blocks along K, the last short
    (4096, 200, 128, 16),   # two chunks a warp: the next chunk's loads during this one
    (4096, 6144, 128, 8),   # Llama-3-8B qkv
    (14336, 512, 128, 8),   # down's K: 14 blocks along K
    (2048, 136, 256, 2),    # groups of two chunks
    (640, 96, -1, 2),       # one group
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_gemv_matches_reference(dtype, k, n, group, chunks, with_bias):
    from runtime_quant import w4a16_cuda
    from runtime_quant.wna16_gpu import _locks

    layer, scheme = make_layer(4, group, k, n, device="cuda", seed=k + n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype).cuda()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).cuda() if with_bias else None
    assert w4a16_cuda.supports(layer, 4, x)
    expected = _reference(layer, scheme, x, bias)
    for variant in w4a16_cuda.VARIANTS:
        variant = dataclasses.replace(variant, chunks_per_block=chunks)
        for _ in range(2):  # the second call finds the counters reset
            out = w4a16_cuda.gemv(layer, x, bias, _locks(x.device), variant)
            assert out.dtype == dtype and out.shape == (1, n)
            torch.testing.assert_close(out.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("k,n,group,chunks", [(1024, 200, 128, 3), (4096, 6144, 128, 16), (640, 96, -1, 2)])
def test_cuda_gemv_of_several_rows(rows, k, n, group, chunks, monkeypatch):
    """2-4 rows (decode batches, speculative verification) of very different magnitudes (each row
    scaled by its own power of two), with bias, through the Triton entry point too."""
    from runtime_quant import w4a16_cuda, wna16_gpu
    from runtime_quant.wna16_gpu import _locks

    monkeypatch.setattr(w4a16_cuda, "MAX_ROWS", w4a16_cuda.KERNEL_MAX_ROWS)
    layer, scheme = make_layer(4, group, k, n, device="cuda", seed=k + rows)
    scale = torch.tensor([10.0 ** (3 * r - 3) for r in range(rows)])[:, None]  # 1e-3, 1, 1e3, 1e6
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * scale).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).cuda()
    assert w4a16_cuda.supports(layer, 4, x)
    expected = _reference(layer, scheme, x, bias)
    variant = dataclasses.replace(w4a16_cuda.MULTI_ROW, chunks_per_block=chunks)
    outputs = [w4a16_cuda.gemv(layer, x, bias, _locks(x.device), variant), wna16_gpu.triton_wna16(layer, scheme, x, bias)]
    for out in outputs:
        assert out.shape == (rows, n)
        for r in range(rows):  # each row against its own scale
            torch.testing.assert_close(out[r].float(), expected[r], atol=2e-3 * expected[r].abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("magnitude", [1e-6, 1e4, 3e6])
def test_cuda_gemv_scales_activations_of_any_range(magnitude):
    """bfloat16 activations whose products and sums would overflow (or underflow) half."""
    from runtime_quant import w4a16_cuda
    from runtime_quant.wna16_gpu import _locks

    layer, scheme = make_layer(4, 128, 1024, 256, device="cuda", seed=5)
    x = (torch.randn(1, 1024, generator=torch.Generator().manual_seed(5)) * magnitude).to(torch.bfloat16).cuda()
    expected = _reference(layer, scheme, x, None)
    variant = dataclasses.replace(w4a16_cuda.DEFAULT, chunks_per_block=2)
    out = w4a16_cuda.gemv(layer, x, None, _locks(x.device), variant).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)


def test_cuda_gemv_under_graph_replay_and_through_the_triton_entry():
    from runtime_quant import w4a16_cuda, wna16_gpu

    layer, scheme = make_layer(4, 128, 4096, 1024, device="cuda", seed=9)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16, device="cuda")
    calls = []
    original = w4a16_cuda.gemv
    w4a16_cuda.gemv = lambda *args, **kw: calls.append(1) or original(*args, **kw)
    try:
        wna16_gpu.triton_wna16(layer, scheme, x, None)  # eager first: compiled and warmed outside the capture
        assert calls, "a one-row bfloat16 call did not take the CUDA GEMV"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = wna16_gpu.triton_wna16(layer, scheme, x, None)
    finally:
        w4a16_cuda.gemv = original
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        expected = _reference(layer, scheme, x, None)
        torch.testing.assert_close(out.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)
    if torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("RUNTIME_WNA16_CUDA_GEMV_PDL", "1") != "0":
        from runtime_kernels import cuda_launch

        assert cuda_launch.pdl_available(torch.cuda.current_device()), "the driver refused the programmatic dependent launch"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("sms", [1, 3])
@pytest.mark.parametrize("k,n", [(1024, 1000), (4096, 1000), (14336, 520)])
def test_cuda_gemv_blocks_of_several_column_runs(rows, sms, k, n, monkeypatch):
    """A grid larger than the GPU holds at once becomes one wave of blocks that take several column runs
    each (here: the GPU made to look like 1 or 3 multiprocessors), with the next run's first chunk loaded
    during the last, the partial sums and counters per run; also the last run partial, with a norm
    prologue (x prepared once a block), and under a graph replayed twice (the counters reset)."""
    from runtime_kernels.norm import rms_norm_ref
    from runtime_quant import w4a16_cuda, wna16_gpu

    monkeypatch.setattr(w4a16_cuda, "_num_sms", lambda index: sms)
    monkeypatch.setattr(w4a16_cuda, "PROLOGUE_MAX_ROWS", w4a16_cuda.KERNEL_MAX_ROWS)
    variant = w4a16_cuda.variant_for(rows)
    runs = -(-n // variant.block_columns)
    assert w4a16_cuda.column_blocks(runs, -(-k // 128 // variant.chunks_per_block), variant.min_blocks, 0) < runs
    layer, scheme = make_layer(4, 128, k, n, device="cuda", seed=k + n + sms)
    g = torch.Generator().manual_seed(rows + sms)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    norm_weight = (torch.randn(k, generator=g) * 0.1 + 1).to(torch.bfloat16).cuda()
    out = w4a16_cuda.gemv(layer, x, None, wna16_gpu._locks(x.device))
    expected = _reference(layer, scheme, x, None)
    torch.testing.assert_close(out.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)
    wna16_gpu.rms_norm_gemv(layer, 4, x, None, norm_weight, 1e-6, False, None)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, _ = wna16_gpu.rms_norm_gemv(layer, 4, x, None, norm_weight, 1e-6, False, None)
    for _ in range(2):
        graph.replay()
        expected = _reference(layer, scheme, rms_norm_ref(x, norm_weight, 1e-6), None)
        torch.testing.assert_close(normed.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("blocks_k", [2, 3, 7, 8, 9])
@pytest.mark.parametrize("sms", [None, 1])
def test_cuda_gemv_cluster_sums_equal_the_global_memory_sums(rows, blocks_k, sms, monkeypatch):
    """On sm_90+, 2-8 blocks along K run as one thread block cluster and block 0 adds the others' sums
    from their shared memory: bit for bit the global-memory sum (same order), with a norm prologue, also
    when each block takes several column runs (the GPU made to look like one multiprocessor) and under a
    graph replayed twice; 9 blocks along K (more than a portable cluster) take the global-memory sum."""
    from runtime_kernels import cuda_launch
    from runtime_kernels.norm import rms_norm_ref
    from runtime_quant import w4a16_cuda, wna16_gpu

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread block clusters need sm_90+")
    if sms is not None:
        monkeypatch.setattr(w4a16_cuda, "_num_sms", lambda index: sms)
    monkeypatch.setattr(w4a16_cuda, "PROLOGUE_MAX_ROWS", w4a16_cuda.KERNEL_MAX_ROWS)
    k, n = blocks_k * 4 * 128, 1000  # 4 chunks a block
    variant = dataclasses.replace(w4a16_cuda.variant_for(rows), chunks_per_block=4)
    layer, scheme = make_layer(4, 128, k, n, device="cuda", seed=k + rows)
    g = torch.Generator().manual_seed(blocks_k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    residual = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    norm_weight = (torch.randn(k, generator=g) * 0.1 + 1).to(torch.bfloat16).cuda()
    clusters = []
    launch = cuda_launch.launch
    monkeypatch.setattr(cuda_launch, "launch", lambda *a, **kw: clusters.append(kw.get("cluster")) or launch(*a, **kw))

    def run():
        return w4a16_cuda.gemv(layer, x, None, wna16_gpu._locks(x.device), variant, prologue=w4a16_cuda.RMS_NORM,
                               residual=residual, norm_weight=norm_weight, residual_out=torch.empty_like(x), eps=1e-6)

    outputs = {}
    for on in (False, True):
        monkeypatch.setattr(w4a16_cuda, "CLUSTERS", on)
        clusters.clear()
        eager = run()
        run()  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run()
        for _ in range(2):
            graph.replay()
            assert torch.equal(replayed, eager)
        assert clusters == [(1, blocks_k, 1) if on and blocks_k <= 8 else None] * 3
        outputs[on] = eager
    assert torch.equal(outputs[True], outputs[False])
    expected = _reference(layer, scheme, rms_norm_ref(x + residual, norm_weight, 1e-6), None)
    torch.testing.assert_close(outputs[True].float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("prologue", ["silu", "rms", "rms-residual", "gemma-residual"])
@pytest.mark.parametrize("k,n", [(4096, 640), (1024, 200)])  # 2 blocks along K (block (0, 0) writes all of s), 1
def test_cuda_gemv_prologues_match_the_separate_ops(rows, prologue, k, n, monkeypatch):
    """The op before the layer computed in the kernel's prologue (SiLU-and-mul, RMSNorm with and
    without a residual, Gemma's RMSNorm) against the separate ops' torch references, then the layer;
    the norm's ``x + residual`` comes back exact, the inputs untouched; 5 rows are not fused."""
    from runtime_kernels.activation import silu_and_mul_ref
    from runtime_kernels.norm import rms_norm_ref
    from runtime_quant import w4a16_cuda, wna16_gpu

    monkeypatch.setattr(w4a16_cuda, "PROLOGUE_MAX_ROWS", w4a16_cuda.KERNEL_MAX_ROWS)  # the kernel's 2-4 rows too
    dtype = torch.bfloat16
    layer, scheme = make_layer(4, 128, k, n, device="cuda", seed=k + rows)
    g = torch.Generator().manual_seed(rows * k)
    x = (torch.randn(rows, 2 * k if prologue == "silu" else k, generator=g) * 3).to(dtype).cuda()
    residual = torch.randn(rows, k, generator=g).to(dtype).cuda() if "residual" in prologue else None
    gemma = prologue.startswith("gemma")
    norm_weight = (torch.randn(k, generator=g) * 0.2 + (0.0 if gemma else 1.0)).to(dtype).cuda()
    bias = torch.randn(n, generator=g).to(dtype).cuda()
    inputs = [t.clone() for t in (x, residual) if t is not None]
    if prologue == "silu":
        op_out = silu_and_mul_ref(x)
        out = wna16_gpu.silu_and_mul_gemv(layer, 4, x, bias)
        assert wna16_gpu.silu_and_mul_gemv(layer, 4, torch.cat([x] * 5)[:5], bias) is None
    else:
        summed = x if residual is None else x + residual
        op_out = rms_norm_ref(summed, norm_weight, 1e-6, gemma)
        out, have_summed = wna16_gpu.rms_norm_gemv(layer, 4, x, residual, norm_weight, 1e-6, gemma, bias)
        assert torch.equal(have_summed, summed) and (residual is not None or have_summed is x)
        assert wna16_gpu.rms_norm_gemv(layer, 4, torch.cat([x] * 5)[:5], None, norm_weight, 1e-6, gemma, bias) is None
    assert all(torch.equal(a, b) for a, b in zip(inputs, (t for t in (x, residual) if t is not None)))
    expected = _reference(layer, scheme, op_out, bias)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("graphs,tp,together", [(True, 1, False), (False, 1, False), (True, 2, False), (True, 1, True)],
                         ids=["graphs", "eager", "graphs-tp2", "graphs-batch-3"])
def test_bf16_gptq_model_decodes_through_the_cuda_gemv(tmp_path, graphs, tp, together, monkeypatch):
    """A GPTQ 4-bit model in bfloat16, one sequence at a time (every decode step is batch 1) or three
    together, with K multiples of 128 (also each rank's half at TP=2): its projections run the CUDA GEMV, and the
    greedy tokens and logprobs stay within bfloat16 rounding of transformers' model with the
    dequantized weights (compared until the first differing token)."""
    if tp > torch.cuda.device_count():
        pytest.skip(f"TP={tp} needs {tp} GPUs")
    from transformers import AutoModelForCausalLM, LlamaConfig
    from wna16_checkpoints import dequantized_reference, write_gptq_checkpoint

    from runtime import LLM, SamplingParams
    from runtime.testing.reference import check_logprobs_close_until_divergence, hf_greedy, make_prompts
    from runtime_quant import w4a16_cuda

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path / "float"))
    path, real = write_gptq_checkpoint(str(tmp_path / "float"), str(tmp_path / "gptq"), 4, 128)
    reference = dequantized_reference(str(tmp_path / "float"), real).to(torch.bfloat16)  # on the CPU
    prompts = make_prompts()[:3]
    expected = hf_greedy(reference, prompts, 16)
    del reference
    calls = []
    original = w4a16_cuda.gemv
    monkeypatch.setattr(w4a16_cuda, "gemv", lambda *args, **kw: calls.append(kw.get("prologue", w4a16_cuda.PLAIN))
                        or original(*args, **kw))
    llm = LLM(path, platform="cuda", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=not graphs,
              cuda_graph_sizes=[1, 2, 4], kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5, detokenize=False)
    if together:  # decode steps of 3 rows
        outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    else:  # every decode step is batch 1
        outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    for out, (ref_tokens, ref_steps) in zip(outputs, expected):
        check_logprobs_close_until_divergence(ref_tokens, ref_steps, out.token_ids, out.logprobs, atol=0.1,
                                              label=f"gptq 4-bit bf16 {'batch 3' if together else 'batch 1'}")
    if tp == 1:  # the workers of TP=2 are other processes
        # every linear of a one-row decode step: qkv and gate_up with their norm, down with the SiLU, o plain
        # (steps of 3 rows run the ops apart: PROLOGUE_MAX_ROWS)
        assert w4a16_cuda.PLAIN in calls, calls
        assert together or {w4a16_cuda.RMS_NORM, w4a16_cuda.SILU_AND_MUL} <= set(calls), calls
    else:
        llm.llm_engine.engine_core.shutdown()
