"""The engine's side of vLLM's request phases: the scheduler stamps when it queued a request and when it
first ran it (a resume after preemption keeps the first), the first token's output carries both, and
/metrics computes queue, prefill, decode and inference time from them and the steps' send times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

import runtime.scheduler.request as request_module
from runtime.messages import ModelRunnerOutput
from runtime.metrics import EngineMetrics


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize("num_blocks, budget, max_tokens", [
    (6, 64, 12),  # two 8-token prompts decode until they collide: one is preempted after its first token
    (4, 4, 8),  # 4-token chunks: the second is preempted in its prefill, before its first token
], ids=["in-decode", "in-prefill"])
def test_phases_with_a_preemption_count_from_the_first_schedule(
    make_scheduler, make_request, monkeypatch, num_blocks, budget, max_tokens,
):
    clock = Clock()
    monkeypatch.setattr(request_module, "time", SimpleNamespace(time=clock.time))
    s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=budget, max_len=64)
    metrics = EngineMetrics("m")
    queued, first_scheduled, scheduled_again, first_token, last_token = {}, {}, {}, {}, {}
    for req_id in "ab":
        s.add_request(make_request(req_id, 8, max_tokens=max_tokens))
        metrics.add_request(req_id, 8, arrival=clock.now - 0.5)
        queued[req_id] = clock.now
        clock.now += 0.25
    num_step_tokens = []
    for _ in range(60):
        clock.now += 1.0
        so = s.schedule()
        for new in so.scheduled_new_reqs:
            (scheduled_again if new.req_id in first_scheduled else first_scheduled).setdefault(new.req_id, clock.now)
        clock.now += 0.5  # the forward pass
        sampled = [rid for rid in so.num_scheduled_tokens if s.requests[rid].num_output_placeholders]
        out = s.update_from_output(so, ModelRunnerOutput(sampled, [[7] for _ in sampled]))
        out.timestamp = clock.now  # as the engine core process stamps what it sends
        num_step_tokens.append(so.total_num_scheduled_tokens)
        for req_id in sampled:
            first_token.setdefault(req_id, clock.now)
            last_token[req_id] = clock.now
        metrics.record(out, now=clock.now + 0.01)
        if not s.has_requests():
            break
    assert not s.has_requests() and s.num_preemptions > 0
    assert scheduled_again, "a request must have been preempted and scheduled again"
    expected = {
        "queue": sum(first_scheduled[r] - queued[r] for r in "ab"),
        "prefill": sum(first_token[r] - first_scheduled[r] for r in "ab"),
        "decode": sum(last_token[r] - first_token[r] for r in "ab"),
        "inference": sum(last_token[r] - first_scheduled[r] for r in "ab"),
    }
    values = {(sample.name, sample.labels.get("engine")): sample.value
              for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples
              if "le" not in sample.labels}
    for phase, seconds in expected.items():
        assert values[(f"vllm:request_{phase}_time_seconds_sum", "0")] == pytest.approx(seconds), phase
        assert values[(f"vllm:request_{phase}_time_seconds_count", "0")] == 2, phase
    assert values[("vllm:num_preemptions_total", "0")] == s.num_preemptions
    assert values[("vllm:iteration_tokens_total_sum", "0")] == sum(num_step_tokens)
    assert values[("vllm:iteration_tokens_total_count", "0")] == sum(1 for n in num_step_tokens if n)


def test_only_the_first_token_output_carries_the_times(make_scheduler, make_request, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(request_module, "time", SimpleNamespace(time=clock.time))
    s = make_scheduler(budget=4)  # a 6-token prompt takes two chunks
    s.add_request(make_request("a", 6, max_tokens=3))
    carried = []
    for step in range(4):
        clock.now += 10.0
        so = s.schedule()
        sampled = [rid for rid in so.num_scheduled_tokens if s.requests[rid].num_output_placeholders]
        out = s.update_from_output(so, ModelRunnerOutput(sampled, [[7] for _ in sampled]))
        carried += [(step, o.queued_time, o.scheduled_time) for o in out.outputs if o.scheduled_time]
    assert carried == [(1, 1000.0, 1010.0)]  # queued when built, first scheduled at step 0, first token at step 1
