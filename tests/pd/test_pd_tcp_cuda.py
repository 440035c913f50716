"""Issue 19 with the TcpConnector between two ``runtime serve`` instances on a GPU: the pulled blocks
are staged in page-locked memory by the pull's thread and written to the decode GPU on a side
stream beside the steps (the CPU serve tests take the same path without a GPU). Both instances
share GPU 0 (one GPU is enough); real processes on loopback, the official openai client.
Completions and chats through the proxy equal a single server's, streamed and not; the decode
instance computes only the prompt's last token; blocks are freed on both sides.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from support.remote_server import SERVER_FLAGS, free_port, wait_for
from test_pd_serve import MAX_TOKENS, PROMPT, USAGE, check_outputs_equal_a_single_server, completion, running_pd, transfer_flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the TcpConnector GPU test needs a CUDA GPU"),
]

FLAGS = SERVER_FLAGS + ["--platform", "cuda", "--enforce-eager"]
ENV = {"CUDA_VISIBLE_DEVICES": "0"}


@pytest.fixture(scope="module")
def pd(tiny_pd_model, tmp_path_factory):
    for prefill, decode, proxy in running_pd(
        tiny_pd_model, tmp_path_factory.mktemp("pd_tcp_cuda"), FLAGS + transfer_flags("kv_producer", free_port(), lease_s=30),
        FLAGS + ["--async-scheduling"] + transfer_flags("kv_consumer", free_port(), pull_timeout_s=5), ENV, ENV,
    ):
        yield prefill, decode, proxy
    for server in (prefill, decode):
        assert "Traceback" not in server.log(), server.log()
    assert "computing its prompt here" not in decode.log() and "KV transfer" not in decode.log(), decode.log()


def test_completions_and_chats_equal_a_single_server(pd):
    prefill, _, proxy = pd
    check_outputs_equal_a_single_server(prefill, proxy)


def test_the_decode_instance_computes_only_the_last_token(pd):
    prefill, decode, proxy = pd
    prompt = "A fresh prompt: " + " ".join(f"item{i}" for i in range(40))
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).json()
    num_prompt, cached = response["usage"]["prompt_tokens"], response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == num_prompt - 1 and cached >= 32, response
    assert response["choices"][0]["text"] == completion(prefill.client(), prompt=prompt)


def test_blocks_are_freed_on_both_sides(pd):
    prefill, decode, proxy = pd
    completion(proxy.client(), prompt=PROMPT + " once more")
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0 and decode.metric(USAGE) == 0.0, 10)
