"""Issue 19 on two GPUs of one host: a prefill ``runtime serve`` on GPU 0 and a decode one on GPU 1
with the CudaIpcConnector (blocks copied GPU to GPU through CUDA IPC, no host copy), behind
``runtime proxy``; real processes on loopback, the official openai client. Completions and chats
through the proxy equal a single server's, streamed and not; the decode instance computes only the
prompt's tail; blocks are freed on both sides; a decode instance that cannot see the prefill GPU
refuses to start, naming the fix.

Placement: the engine runs on its first visible GPU, so the prefill instance runs with
``CUDA_VISIBLE_DEVICES=0,1`` and the decode instance with ``CUDA_VISIBLE_DEVICES=1,0`` (it must see
the prefill GPU to open its memory).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from support.remote_server import SERVER_FLAGS, RemoteServer, free_port, wait_for
from test_pd_serve import MAX_TOKENS, PROMPT, USAGE, check_outputs_equal_a_single_server, completion, running_pd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="the CudaIpcConnector test needs 2 CUDA GPUs of one host (prefill on GPU 0, decode on GPU 1)"),
]

FLAGS = SERVER_FLAGS + ["--platform", "cuda", "--enforce-eager"]
PREFILL_ENV, DECODE_ENV = {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1,0"}


def ipc_flags(role: str, port: int, **extra) -> list[str]:
    config = {"kv_connector": "CudaIpcConnector", "kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pd(tiny_pd_model, tmp_path_factory):
    """(prefill server on GPU 0, decode server on GPU 1, proxy), started side by side."""
    for prefill, decode, proxy in running_pd(
        tiny_pd_model, tmp_path_factory.mktemp("pd_ipc"), FLAGS + ipc_flags("kv_producer", free_port(), lease_s=30),
        FLAGS + ipc_flags("kv_consumer", free_port(), pull_timeout_s=5), PREFILL_ENV, DECODE_ENV,
    ):
        yield prefill, decode, proxy
    for server in (prefill, decode):
        assert "Traceback" not in server.log(), server.log()
    assert "computing its prompt here" not in decode.log() and "KV transfer" not in decode.log(), decode.log()


def test_completions_and_chats_equal_a_single_server(pd):
    prefill, _, proxy = pd
    check_outputs_equal_a_single_server(prefill, proxy)


def test_the_decode_instance_computes_only_the_tail(pd):
    prefill, decode, proxy = pd
    hits_before = decode.metric("runtime:prefix_cache_hits_total")
    prompt = "A fresh prompt on two GPUs: " + " ".join(f"item{i}" for i in range(40))
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).json()
    num_prompt, cached = response["usage"]["prompt_tokens"], response["usage"]["prompt_tokens_details"]["cached_tokens"]
    # every prompt token but the last, the last block partly full: the decode instance computes one token
    assert cached == num_prompt - 1 and cached % 16 and cached >= 32, response
    assert decode.metric("runtime:prefix_cache_hits_total") == hits_before  # copied from GPU 0, not found on GPU 1
    assert response["choices"][0]["text"] == completion(prefill.client(), prompt=prompt)


def test_blocks_are_freed_on_both_sides(pd):
    prefill, decode, proxy = pd
    texts = [completion(proxy.client(), prompt=PROMPT + f" round {i}") for i in range(4)]
    assert all(texts)
    # the prefill lease (30 s) ends by the decode worker's "pulled" notice after its copy, not by expiry
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0 and decode.metric(USAGE) == 0.0, 10)


def test_a_decode_instance_that_cannot_see_the_prefill_gpu_refuses_to_start(tiny_pd_model, tmp_path):
    decode = RemoteServer(tiny_pd_model, FLAGS + ipc_flags("kv_consumer", free_port()), tmp_path / "decode.log",
                          env={"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(RuntimeError, match=r"sees 1 of the host's \d+ GPUs \(CUDA_VISIBLE_DEVICES=1\)"):
        decode.wait_ready(120)
    decode.stop()
