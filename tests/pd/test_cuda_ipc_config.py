"""The CudaIpcConnector on the CPU: its configuration and bad inputs are refused by name (a role,
an extra key, a KV cache that is not on a CUDA GPU, a decode instance that cannot see or reach the
prefill GPU); a claim that cannot be used falls back like a failed TCP pull (the prefill instance
is told to free the blocks, the request computes its prompt), and a claim near its lease's end is
not loaded."""

from __future__ import annotations

import time
import types

import msgspec
import pytest
import zmq

from runtime.kv_transfer import parse_transfer_config
from runtime_pd.cuda_ipc import ClaimReply, LayerHandle, PeerExport, peer_problem, startup_problem
from runtime_pd.ipc_scheduler import CLAIM_MARGIN_S, Claimed, Claimer, PeerLoad
from runtime_pd.settings import settings_of
from runtime_pd.wire import decode_pulled, decode_request
from support.remote_server import free_port

OWN, PEER, OTHER = "uuid-own", "uuid-peer", "uuid-other"
LAYERS = [["bfloat16", [2, 16, 8, 128]]] * 2


def engine_config(transfer: dict):
    cache = types.SimpleNamespace(kv_transfer_config=parse_transfer_config(transfer), block_size=16, cache_dtype="auto",
                                  kv_block_layout="")
    return types.SimpleNamespace(cache_config=cache)


def test_roles_and_extra_keys_are_checked_by_name():
    with pytest.raises(ValueError, match=r"kv_role 'prefill' is not valid; choose one of: kv_producer, kv_consumer, kv_both"):
        parse_transfer_config({"kv_connector": "CudaIpcConnector", "kv_role": "prefill"})
    with pytest.raises(ValueError, match=r"CudaIpcConnector: unknown kv_connector_extra_config key\(s\) 'checksum'; "
                                         r"valid keys: lease_s, pull_timeout_s, on_transfer_failure"):
        settings_of(engine_config({"kv_connector": "CudaIpcConnector", "kv_connector_extra_config": {"checksum": True}}))
    with pytest.raises(ValueError, match=r"CudaIpcConnector: on_transfer_failure 'retry' is not valid"):
        settings_of(engine_config({"kv_connector": "CudaIpcConnector",
                                   "kv_connector_extra_config": {"on_transfer_failure": "retry"}}))
    settings = settings_of(engine_config({"kv_connector": "CudaIpcConnector", "kv_role": "kv_consumer", "kv_port": 20011}))
    assert settings.is_consumer and not settings.is_producer and settings.control_port == 20012


def test_a_kv_cache_off_the_gpu_is_refused_at_start(tiny_pd_model):
    from runtime import LLM

    with pytest.raises(ValueError, match=r"CudaIpcConnector copies KV blocks between CUDA GPUs of one host; this "
                                         r"instance's KV cache is on cpu: use TcpConnector"):
        LLM(tiny_pd_model, kv_transfer_config={"kv_connector": "CudaIpcConnector", "kv_role": "kv_consumer"},
            platform="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64, enforce_eager=True)


def test_a_decode_instance_that_sees_one_gpu_of_several_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    why = startup_problem(OWN, {OWN: True}, num_host_gpus=2)
    assert "sees 1 of the host's 2 GPUs (CUDA_VISIBLE_DEVICES=1)" in why and "CUDA_VISIBLE_DEVICES=1,0" in why
    assert startup_problem(OWN, {OWN: True}, num_host_gpus=1) is None  # one GPU: prefill and decode share it
    assert startup_problem(OWN, {OWN: True}, num_host_gpus=-1) is None  # NVML unknown: left to the first pull
    why = startup_problem(OWN, {OWN: True, PEER: False}, num_host_gpus=2)
    assert f"GPU {OWN} has no peer access to any other visible GPU ({PEER})" in why and "use TcpConnector" in why
    assert startup_problem(OWN, {OWN: True, PEER: True, OTHER: False}, num_host_gpus=3) is None  # warned only


def test_the_prefill_gpu_must_be_visible_and_reachable():
    access = {OWN: True, PEER: True, OTHER: False}
    assert peer_problem(PEER, OWN, access) is None and peer_problem(OWN, OWN, access) is None
    why = peer_problem("uuid-hidden", OWN, access)
    assert "the prefill instance's GPU uuid-hidden is not visible to this decode instance (visible: uuid-own, uuid-peer" in why
    assert peer_problem(OTHER, OWN, access) == f"this decode instance's GPU {OWN} has no peer access to the prefill instance's GPU {OTHER}"


def export(device_uuid: str, layers=LAYERS) -> PeerExport:
    handles = [LayerHandle(dtype, [64, *shape], [], 0, b"h%d" % i, 1, 0, b"r", 0, b"e") for i, (dtype, shape) in enumerate(layers)]
    return PeerExport(device_uuid, handles)


class FakeProducer:
    """A prefill instance's block server answering every pull with ``reply``, and its notice port."""

    def __init__(self, reply: ClaimReply):
        self.context = zmq.Context()
        self.context.setsockopt(zmq.LINGER, 0)
        self.reply = reply
        for _ in range(20):  # the notice port is the block server's + 1: both free, or another pair (other tests bind too)
            self.port = free_port()
            self.server, self.notices = self.context.socket(zmq.ROUTER), self.context.socket(zmq.PULL)
            try:
                self.server.bind(f"tcp://127.0.0.1:{self.port}")
                self.notices.bind(f"tcp://127.0.0.1:{self.port + 1}")
                return
            except zmq.ZMQError:
                self.server.close()
                self.notices.close()
        self.context.destroy()
        raise RuntimeError("found no two free ports in a row for the fake producer")

    def answer(self) -> str:
        assert self.server.poll(5000)
        identity, payload = self.server.recv_multipart()
        self.server.send_multipart([identity, msgspec.msgpack.encode(self.reply)])
        return decode_request(payload).request_id

    def notice(self, timeout_ms: int = 2000):
        return decode_pulled(self.notices.recv()) if self.notices.poll(timeout_ms) else None

    def close(self):
        self.context.destroy(linger=0)


def claim(reply: ClaimReply):
    """A Claimer on GPU OWN (which reaches PEER) pulls from a fake producer: (its result, the notice it got)."""
    producer = FakeProducer(reply)
    claimer = Claimer("layout", timeout_s=5)
    claimer.device_uuid, claimer.access, claimer.layers = OWN, {OWN: True, PEER: True}, LAYERS
    params = {"remote_host": "127.0.0.1", "remote_port": producer.port, "remote_engine_id": "e", "remote_request_id": "r",
              "remote_block_ids": [3, 4], "num_remote_tokens": 32}
    try:
        claimer.start("d", params)
        assert producer.answer() == "r"
        deadline = time.monotonic() + 5
        while not claimer.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        request_id, result = claimer.ended.popleft()
        assert request_id == "d"
        return result, producer.notice(500 if not isinstance(result, str) else 2000)
    finally:
        claimer.close()
        producer.close()


def test_a_claim_of_a_reachable_gpu_waits_for_the_copy_to_release_the_blocks():
    result, notice = claim(ClaimReply(lease_left_s=30.0, export=export(PEER)))
    assert isinstance(result, Claimed) and notice is None  # the worker tells the producer after its copy
    assert result.stale_reason() is None and 30 - CLAIM_MARGIN_S - 1 < result.expires_at - time.monotonic() <= 30 - CLAIM_MARGIN_S
    load = result.load_entry([10, 11, 12], 1, 2)
    assert isinstance(load, PeerLoad) and load.block_ids == [11] and load.remote_block_ids == [4]


@pytest.mark.parametrize("reply, reason", [
    (ClaimReply(lease_left_s=30.0, export=export("uuid-hidden")), "the prefill instance's GPU uuid-hidden is not visible"),
    (ClaimReply(lease_left_s=30.0, export=export(PEER, LAYERS[:1])), "differ from this cache's"),
    (ClaimReply(error="no blocks are leased to request 'r'"), "no blocks are leased to request 'r'"),
])
def test_an_unusable_claim_fails_like_a_pull_and_frees_the_prefill_blocks(reply, reason):
    result, notice = claim(reply)
    assert isinstance(result, str) and reason in result and "KV transfer from the prefill instance at 127.0.0.1" in result
    assert notice is not None and notice.request_id == "r" and notice.engine_id == "e"


def test_a_claim_near_its_lease_end_is_not_loaded():
    stale = Claimed([], 32, remote_block_ids=[3, 4], export=export(PEER), params={}, expires_at=time.monotonic() - 0.1)
    assert "lease on the prefill instance ends before the blocks could be copied" in stale.stale_reason()
    assert not Claimed.released_at_pull


def consumer_scheduler():
    from runtime_pd.ipc_scheduler import CudaIpcConnectorScheduler

    config = engine_config({"kv_connector": "CudaIpcConnector", "kv_role": "kv_consumer", "engine_id": "d"})
    config.model_config = types.SimpleNamespace(architecture="LlamaForCausalLM", dtype="bfloat16",
                                                hf_config=types.SimpleNamespace(num_hidden_layers=2))
    return CudaIpcConnectorScheduler(config)


@pytest.mark.parametrize("how", ["stale at admission", "aborted before admission", "all in the local prefix cache"])
def test_a_claim_that_is_not_copied_frees_the_prefill_blocks(how):
    from runtime import SamplingParams
    from runtime.scheduler.request import Request, RequestStatus

    producer = FakeProducer(ClaimReply())
    sched = consumer_scheduler()
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": producer.port, "remote_engine_id": "e",
              "remote_request_id": "r", "remote_block_ids": [3, 4], "num_remote_tokens": 32}
    request = Request("d", list(range(1, 40)), SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params}),
                      eos_token_ids=frozenset())
    expires_at = time.monotonic() + (-1 if how == "stale at admission" else 30)
    sched.pulls["d"] = Claimed([], 32, remote_block_ids=[3, 4], export=export(PEER), params=params, expires_at=expires_at)
    try:
        if how == "stale at admission":
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # computes its prompt here
            assert sched.num_failed_pulls == 1 and "ends before the blocks could be copied" in sched.pulls["d"]
        elif how == "aborted before admission":
            request.status = RequestStatus.FINISHED_ABORTED
            assert sched.request_finished(request, []) == (False, None)
        else:
            assert sched.get_num_new_matched_tokens(request, 32) == (0, False)
            sched.update_state_after_alloc(request, [7, 8, 9], 0)
            assert sched.build_connector_meta(None).loads == []
        notice = producer.notice()
        assert notice is not None and (notice.engine_id, notice.request_id) == ("e", "r")
    finally:
        sched.shutdown()
        producer.close()
