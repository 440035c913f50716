"""The TcpConnector in-process (offline ``LLM``): with ``on_transfer_failure: fail`` a pull that
gets no answer fails the request with an error naming the prefill instance; an abort of a
decode request waiting for its pull, and of a finished prefill's lease, frees everything."""

from __future__ import annotations

import time

import pytest

from support.remote_server import free_port, wait_for

COMMON = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, enforce_eager=True)
PROMPT = list(range(1, 60))


def connector(role: str, port: int | None = None, **extra) -> dict:
    config = {"kv_connector": "TcpConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return {**config, "kv_port": port} if port else config


def remote_params(port: int, num_blocks: int = 3) -> dict:
    from runtime_pd.settings import prompt_digest

    return {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "r", "remote_host": "127.0.0.1",
            "remote_port": port, "remote_block_ids": list(range(num_blocks)), "num_remote_tokens": 16 * num_blocks,
            "block_size": 16, "prompt_digest": prompt_digest(PROMPT[: 16 * num_blocks])}


@pytest.fixture(scope="module")
def fail_mode_llm(tiny_pd_model):
    from runtime import LLM

    return LLM(tiny_pd_model, kv_transfer_config=connector("kv_consumer", pull_timeout_s=0.5, on_transfer_failure="fail"),
               **COMMON)


def params(kv_transfer_params: dict, max_tokens: int = 4):
    from runtime import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params})


def test_fail_mode_fails_the_request_with_a_clear_error(fail_mode_llm):
    dead = free_port()  # nothing listens there
    from runtime.engine.core_client import RequestFailedError

    # the server's failure, not the caller's input: RequestFailedError (a 500 on the server), not ValueError (a 400)
    with pytest.raises(RequestFailedError, match=rf"KV transfer from the prefill instance at 127.0.0.1:{dead} failed: "
                                                 r"no answer within 0.5 s") as info:
        fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], params(remote_params(dead)), use_tqdm=False)
    assert not isinstance(info.value, ValueError)
    core = fail_mode_llm.llm_engine.engine_core
    assert not core.has_unfinished_requests() and core.scheduler.kv_cache_manager.usage() == 0.0


def test_a_mismatched_prompt_is_refused_before_any_pull(fail_mode_llm):
    other = remote_params(free_port())
    other["prompt_digest"] = "0" * 32
    with pytest.raises(ValueError, match=r"the prompt differs from the one the prefill instance computed"):
        fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], params(other), use_tqdm=False)


def test_a_one_token_prompt_pulls_nothing(fail_mode_llm):
    """A one-token prompt leaves the prefill instance no tokens to hand over (it leases no blocks): the decode
    instance computes it at once (before, it pulled a lease that was never made: waited for the pull's timeout,
    which fails the request in fail mode, and held the prefill instance's block server meanwhile)."""
    from runtime_pd.settings import prompt_digest

    empty = {**remote_params(free_port(), 0), "remote_block_ids": [], "num_remote_tokens": 0, "prompt_digest": prompt_digest([])}
    (pulled,) = fail_mode_llm.generate([{"prompt_token_ids": PROMPT[:1]}], params(empty), use_tqdm=False)
    (local,) = fail_mode_llm.generate([{"prompt_token_ids": PROMPT[:1]}], params({}), use_tqdm=False)
    assert pulled.outputs[0].token_ids == local.outputs[0].token_ids and len(local.outputs[0].token_ids) == 4


def test_aborts_free_both_sides(tiny_pd_model, fail_mode_llm):
    from runtime import LLM

    port = free_port()
    producer = LLM(tiny_pd_model, kv_transfer_config=connector("kv_producer", port, lease_s=60), **COMMON)
    out = producer.generate([{"prompt_token_ids": PROMPT}], params({"do_remote_decode": True}, 1), use_tqdm=False)[0]
    transfer = out.kv_transfer_params
    prefill_core = producer.llm_engine.engine_core
    assert prefill_core.scheduler.kv_cache_manager.usage() > 0  # leased for 60 s
    # The decode side adds the request and aborts it while its pull waits (the prefill engine does not step, so
    # the lease has not reached its block server yet): the pull is answered once it does, and its notice frees the lease.
    decode = fail_mode_llm.llm_engine
    decode.add_request("d", {"prompt_token_ids": PROMPT}, params(transfer))
    decode.step()
    assert decode.engine_core.scheduler.kv_connector.waiting_remote
    decode.abort_request(["d"])
    assert not decode.engine_core.has_unfinished_requests()

    def freed():
        prefill_core.step()
        return prefill_core.scheduler.kv_cache_manager.usage() == 0.0

    assert wait_for(freed, 10)
    time.sleep(0.1)
    assert decode.engine_core.scheduler.kv_cache_manager.usage() == 0.0


def test_a_prefill_instance_refuses_a_decode_instance_of_another_block_order(tiny_pd_model, fail_mode_llm, monkeypatch):
    """Both instances' layout keys come from their workers (the connector handshake), so they include the attention
    backend's order of a block's bytes (``kv_block_layout``, as the triton backend's for an 8-bit cache): a prefill
    instance in another order refuses the pull rather than hand over blocks the decode instance would misread."""
    from runtime import LLM
    from runtime_cpu.attention import CPUPagedAttentionBackend

    monkeypatch.setattr(CPUPagedAttentionBackend, "kv_block_layout", lambda self, dtype: "test-order", raising=False)
    port = free_port()
    producer = LLM(tiny_pd_model, kv_transfer_config=connector("kv_producer", port, lease_s=60), **COMMON)
    decode_layout = fail_mode_llm.llm_engine.engine_core.scheduler.kv_connector.connector.puller.layout
    assert producer.llm_engine.engine_core.scheduler.kv_connector.connector.layout != decode_layout
    out = producer.generate([{"prompt_token_ids": PROMPT}], params({"do_remote_decode": True}, 1), use_tqdm=False)[0]
    from runtime.engine.core_client import RequestFailedError

    # the instances' configurations differ: the server's failure (a 500), not the caller's input
    with pytest.raises(RequestFailedError, match=r"different model layout \(.*order of a block's bytes\)"):
        fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], params(out.kv_transfer_params), use_tqdm=False)
    assert fail_mode_llm.llm_engine.engine_core.scheduler.kv_cache_manager.usage() == 0.0
    # a decode instance in the same order pulls the blocks and decodes on from them
    same = LLM(tiny_pd_model, kv_transfer_config=connector("kv_consumer", on_transfer_failure="fail"), **COMMON)
    assert same.llm_engine.engine_core.scheduler.kv_connector.connector.puller.layout == \
        producer.llm_engine.engine_core.scheduler.kv_connector.connector.layout
    out = producer.generate([{"prompt_token_ids": PROMPT}], params({"do_remote_decode": True}, 1), use_tqdm=False)[0]
    producer.llm_engine.engine_core.step()  # the step that hands the lease to the producer's block server
    (pulled,) = same.generate([{"prompt_token_ids": PROMPT}], params(out.kv_transfer_params), use_tqdm=False)
    (local,) = producer.generate([{"prompt_token_ids": PROMPT}], params({}), use_tqdm=False)
    assert pulled.outputs[0].token_ids == local.outputs[0].token_ids
    assert same.llm_engine.engine_core.scheduler.stats()["kv_transfer_failed_pulls"] == 0


def test_n_samples_of_a_pulled_prompt_share_one_pull(tiny_pd_model, fail_mode_llm):
    """``n > 1`` on both sides. Decode: the samples carry the same kv_transfer_params, and a prefill instance serves a lease once (the
    pull frees it). One sample pulls, the others wait for that pull and load the same blocks (before, each pulled:
    the second pull waited for a lease already gone and failed the request, or recomputed after the timeout)."""
    from runtime import LLM, SamplingParams

    port = free_port()
    producer = LLM(tiny_pd_model, kv_transfer_config=connector("kv_producer", port, lease_s=60), **COMMON)
    # The prefill of an n > 1 request leases one copy of the prompt's blocks, and its output says where (before,
    # every sample leased its own copy, held until the lease expired, and the output carried no kv_transfer_params).
    prefill = SamplingParams(temperature=0, max_tokens=1, n=3, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = producer.generate([{"prompt_token_ids": PROMPT}], prefill, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and out.kv_transfer_params is not None
    assert list(producer.llm_engine.engine_core.scheduler.kv_connector.connector.leases.deadlines) == [
        out.kv_transfer_params["remote_request_id"]]
    producer.llm_engine.engine_core.step()  # the step that hands the lease to the producer's block server
    scheduler = fail_mode_llm.llm_engine.engine_core.scheduler
    before = scheduler.stats()
    sampled = SamplingParams(temperature=0, max_tokens=6, n=3, extra_args={"kv_transfer_params": out.kv_transfer_params})
    (pulled,) = fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], sampled, use_tqdm=False)
    (local,) = fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], params({}, 6), use_tqdm=False)
    assert [c.token_ids for c in pulled.outputs] == [local.outputs[0].token_ids] * 3
    stats = scheduler.stats()
    assert stats["kv_transfer_failed_pulls"] == before["kv_transfer_failed_pulls"]
    assert stats["kv_transfer_pulled_blocks"] - before["kv_transfer_pulled_blocks"] == len(out.kv_transfer_params["remote_block_ids"])
    assert scheduler.kv_cache_manager.usage() == 0.0


def test_a_restarted_prefill_instance_with_the_same_ids_is_pulled_again(tiny_pd_model, fail_mode_llm):
    """A prefill instance started again under the same engine_id restarts its request ids: its lease of request 0
    is not the one of the run before, so the decode instance pulls it (the lease key holds the instance's start)."""
    import gc

    from runtime import LLM, SamplingParams

    scheduler = fail_mode_llm.llm_engine.engine_core.scheduler
    prefill = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    seen = []
    for _ in range(2):
        port = free_port()
        producer = LLM(tiny_pd_model, kv_transfer_config={**connector("kv_producer", port, lease_s=60), "engine_id": "p"},
                       **COMMON)
        out = producer.generate([{"prompt_token_ids": PROMPT}], prefill, use_tqdm=False)[0]
        producer.llm_engine.engine_core.step()  # the lease reaches the producer's block server
        seen.append((out.kv_transfer_params["remote_engine_id"], out.kv_transfer_params["remote_request_id"]))
        before = scheduler.stats()["kv_transfer_pulled_blocks"]
        (pulled,) = fail_mode_llm.generate([{"prompt_token_ids": PROMPT}], params(out.kv_transfer_params, 4), use_tqdm=False)
        assert scheduler.stats()["kv_transfer_pulled_blocks"] - before == len(out.kv_transfer_params["remote_block_ids"])
        del producer
        gc.collect()
    assert seen[0] == seen[1]  # the same engine id and request id both times
