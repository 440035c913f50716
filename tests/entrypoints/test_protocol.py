"""The parts of the server that need no model: request -> SamplingParams, errors, metrics, the engine wire."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from runtime.engine import core_proc
from runtime.engine.core_client import _outputs_decoder
from runtime.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from runtime.entrypoints.openai.errors import from_exception, param_of
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from runtime.metrics import EngineMetrics
from runtime.sampling_params import RequestOutputKind, SamplingParams


def test_completion_request_to_sampling_params():
    request = CompletionRequest(
        prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, seed=3, stop="END",
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=2, echo=True,
        logit_bias={"12": 5.0}, n=2, stream=True,
    )
    params = request.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (7, 0.5, 0.9, 20, 0.1)
    assert (params.seed, params.stop, params.n, params.logprobs) == (3, ["END"], 2, 2)
    assert params.prompt_logprobs == 2  # echo with logprobs scores the prompt too
    assert params.logit_bias == {12: 5.0}
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert params.output_kind == RequestOutputKind.DELTA
    unary = CompletionRequest(prompt="hi").to_sampling_params()
    assert (unary.max_tokens, unary.temperature, unary.logprobs, unary.prompt_logprobs) == (16, 1.0, None, None)
    assert unary.output_kind == RequestOutputKind.FINAL_ONLY


def test_chat_request_to_sampling_params():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    request = ChatCompletionRequest(messages=messages, max_tokens=9, max_completion_tokens=4, logprobs=True, top_logprobs=3)
    params = request.to_sampling_params()
    assert params.max_tokens == 4 and params.logprobs == 3  # max_completion_tokens wins
    assert request.messages[0].to_template_dict() == {"role": "user", "content": "a\nb"}
    assert ChatCompletionRequest(messages=messages).to_sampling_params().max_tokens is None  # up to max_model_len
    assert ChatCompletionRequest(messages=messages, logprobs=True).to_sampling_params().logprobs == 0


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(prompt="hi", logprobs=-1), "logprobs must be an integer >= 0, got -1"),
        (dict(prompt="hi", logit_bias={"a": 1.0}), "logit_bias keys must be token ids"),
        (dict(prompt="hi", logit_bias={"5": 200.0}), r"logit_bias values must be in [-100, 100]"),
        (dict(prompt="hi", temperature=-1.0), "temperature must be >= 0, got -1.0"),
        (dict(prompt="hi", max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    ],
)
def test_bad_values_raise_value_errors_naming_the_field(request_kwargs, message):
    with pytest.raises(ValueError) as info:
        CompletionRequest(**request_kwargs).to_sampling_params()
    assert message in str(info.value)
    error = from_exception(info.value)
    assert error.status == 400 and error.param == message.split()[0]
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_unsupported_fields_are_rejected():
    with pytest.raises(ValueError, match="best_of must equal n"):
        CompletionRequest(prompt="hi", best_of=3).check_supported()
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=true"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).to_sampling_params()
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert param_of("prompt has 300 tokens, but max_model_len is 256") == "prompt"
    assert param_of("something else entirely") is None


def test_metrics_timings_and_counts():
    metrics = EngineMetrics("m")
    metrics.add_request("a", num_prompt_tokens=5, arrival=100.0)
    metrics.add_request("b", num_prompt_tokens=3, arrival=100.0)
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 8, "prefix_cache_hits": 2}
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1]), EngineCoreOutput("b", [1])], scheduler_stats=stats), now=100.5)
    metrics.record(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [2, 3], finish_reason=FinishReason.LENGTH)]), now=101.5)
    metrics.end_requests(["b"], "abort", now=102.0)
    text = metrics.render().decode()

    def value(line_start: str) -> float:
        return float(next(l for l in text.splitlines() if l.startswith(line_start)).rsplit(" ", 1)[1])

    assert value('runtime:prompt_tokens_total{model_name="m"}') == 8
    assert value('runtime:generation_tokens_total{model_name="m"}') == 4
    assert value('runtime:time_to_first_token_seconds_sum{model_name="m"}') == pytest.approx(1.0)  # 0.5 + 0.5
    assert value('runtime:time_per_output_token_seconds_sum{model_name="m"}') == pytest.approx(0.5)  # 1s over 2 tokens
    assert value('runtime:e2e_request_latency_seconds_sum{model_name="m"}') == pytest.approx(1.5 + 2.0)
    assert value('runtime:request_success_total{finished_reason="length"') == 1
    assert value('runtime:request_success_total{finished_reason="abort"') == 1
    assert value('runtime:num_requests_running{model_name="m"}') == 2
    assert value('runtime:kv_cache_usage_perc{model_name="m"}') == 0.25
    assert value('runtime:prefix_cache_hit_rate{model_name="m"}') == 0.25
    metrics.record(EngineCoreOutputs(scheduler_stats={**stats, "prefix_cache_queries": 10, "prefix_cache_hits": 4}))
    assert 'runtime:prefix_cache_hits_total{model_name="m"} 4.0' in metrics.render().decode()


class FakeCore:
    """Echoes each prompt's last token once, then finishes it; records aborts."""

    def __init__(self):
        self.model_config = type("MC", (), {"eos_token_ids": (2,)})()
        self.pending: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.scheduler = type("S", (), {"stats": lambda s: {"num_running": len(self.pending)}})()

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.prompt_token_ids == [666]:
            raise ValueError("prompt token id 666 is out of range")
        self.pending.append(request)

    def abort_requests(self, ids) -> None:
        self.aborted += ids
        self.pending = [r for r in self.pending if r.request_id not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> EngineCoreOutputs:
        request = self.pending.pop(0)
        out = EngineCoreOutput(request.request_id, [request.prompt_token_ids[-1]], finish_reason=FinishReason.LENGTH)
        return EngineCoreOutputs(outputs=[out], scheduler_stats={"num_running": len(self.pending)})


def _send(sock, kind: bytes, client: int, payload) -> None:
    sock.send_multipart([kind, bytes([client]), payload if isinstance(payload, bytes) else core_proc.encode(payload)])


def test_engine_core_proc_wire_protocol_routes_each_client_its_own():
    """Two API clients: each gets the outputs and failures of the requests it added; client 0 the stats."""
    ctx = zmq.Context()
    engine_in = ctx.socket(zmq.PULL)
    senders, engine_outs, receivers = [], [], []
    for i in range(2):
        sender, engine_out, receiver = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        sender.bind(f"inproc://in{i}"), engine_in.connect(f"inproc://in{i}")
        receiver.bind(f"inproc://out{i}"), engine_out.connect(f"inproc://out{i}")
        senders.append(sender), engine_outs.append(engine_out), receivers.append(receiver)
    core = FakeCore()
    proc = core_proc.EngineCoreProc(core, engine_in, engine_outs, parent_pid=__import__("os").getppid())
    thread = threading.Thread(target=proc.run)
    thread.start()
    params = SamplingParams(min_tokens=2, stop_token_ids=[7])
    _send(senders[0], core_proc.ADD, 0, EngineCoreRequest("r1", [5, 9], params, eos_token_id=3))
    _send(senders[0], core_proc.ADD, 0, EngineCoreRequest("bad", [666], SamplingParams()))
    _send(senders[1], core_proc.ADD, 1, EngineCoreRequest("r2", [4, 8], SamplingParams()))
    received: list[dict] = [{}, {}]
    num_stats = [0, 0]
    while set(received[0]) | set(received[1]) != {"r1", "bad", "r2"}:
        for client, receiver in enumerate(receivers):
            if not receiver.poll(10):
                continue
            kind, payload = receiver.recv_multipart()
            if kind == core_proc.OUTPUTS:
                outputs = _outputs_decoder.decode(payload)
                num_stats[client] += outputs.scheduler_stats is not None
                received[client].update((out.request_id, out) for out in outputs.outputs)
            elif kind == core_proc.FAILED:
                received[client]["bad"] = msgspec.msgpack.decode(payload)
    assert set(received[0]) == {"r1", "bad"} and set(received[1]) == {"r2"}
    assert received[0]["r1"].new_token_ids == [9] and received[0]["r1"].finish_reason == FinishReason.LENGTH
    assert received[1]["r2"].new_token_ids == [8]
    assert received[0]["bad"] == ["bad", "prompt token id 666 is out of range"]
    assert num_stats[0] >= 1 and num_stats[1] == 0
    _send(senders[1], core_proc.ABORT, 1, ["x"])
    _send(senders[0], core_proc.SHUTDOWN, 0, b"")
    thread.join(10)
    assert not thread.is_alive() and core.aborted == ["x"] and proc._owner == {}
    for sock in (engine_in, *senders, *engine_outs, *receivers):
        sock.close(linger=0)
    ctx.term()


def test_stop_token_ids_survive_the_wire():
    """all_stop_token_ids (the min_tokens mask) crosses the socket unchanged."""
    params = SamplingParams(stop_token_ids=[7], min_tokens=3)
    params.all_stop_token_ids = {7, 2, 3}
    request = EngineCoreRequest("r", [1], params, eos_token_id=3)
    decoded = msgspec.msgpack.decode(core_proc.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.all_stop_token_ids == {7, 2, 3}


def test_logprobs_above_openais_20_reach_the_max_logprobs_check():
    """Only the sign is checked here: --max-logprobs (default 20) bounds the count, so a server
    started with a higher limit accepts more."""
    from runtime.entrypoints.openai.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt="hi", logprobs=25).to_sampling_params().logprobs == 25
