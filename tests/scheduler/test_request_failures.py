"""A request a KV connector fails is an input error (a 400: ``RequestInputError``, e.g. malformed
``kv_transfer_params``) or the server's failure (a 500: a plain reason, e.g. a transfer that failed):
the scheduler says which in ``EngineCoreOutputs.server_failed``, the front ends raise ValueError or
RequestFailedError, and the server answers 400 or 500."""

from __future__ import annotations

from test_kv_connector_scheduling import BLOCK, Meta

from runtime.config import CacheConfig, SchedulerConfig
from runtime.engine.core_client import RequestFailedError, RequestFailure
from runtime.entrypoints.openai.errors import from_exception
from runtime.kv_transfer import RequestInputError
from runtime.messages import ModelRunnerOutput
from runtime.scheduler.scheduler import Scheduler

WHY = {"transfer": "the prefill instance went away", "input": RequestInputError("kv_transfer_params lacks remote_host")}


class RemoteConnector:
    """Every request's prompt but its last block loads asynchronously, and fails: ``WHY[request_id]``."""

    def __init__(self):
        self.pending: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.pending.append(request.request_id)
        return (request.num_tokens - 1) // BLOCK * BLOCK, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return Meta()

    def request_finished(self, request, block_ids):
        return False, None

    def get_finished_recving(self):
        ended, self.pending = {rid: WHY[rid] for rid in self.pending}, []
        return ended


def test_the_scheduler_tells_the_servers_failures_from_input_errors(make_request):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, CacheConfig(block_size=BLOCK, enable_prefix_caching=True), 16, kv_connector=RemoteConnector())
    for request_id in WHY:
        sched.add_request(make_request(request_id, list(range(1, 14))))
    for _ in range(3):
        output = sched.schedule()
        outputs = sched.update_from_output(output, ModelRunnerOutput(list(output.num_scheduled_tokens), []))
        if outputs.failed:
            break
    assert outputs.failed == {rid: str(why) for rid, why in WHY.items()}
    assert outputs.server_failed == ["transfer"]
    assert not sched.requests and sched.kv_cache_manager.usage() == 0.0


def test_front_ends_answer_a_400_or_a_500():
    server = RequestFailure("r1", "the prefill instance went away", server_side=True).error()
    client = RequestFailure("r2", "kv_transfer_params lacks remote_host").error()
    assert isinstance(server, RequestFailedError) and type(client) is ValueError
    assert from_exception(server).status == 500 and from_exception(server).body()["error"]["type"] == "server_error"
    assert from_exception(client).status == 400
