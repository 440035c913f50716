"""A step's outputs as one list of records, for tests that look at every request's output."""

from __future__ import annotations

from runtime.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput


def step_records(so: SchedulerOutput, out: EngineCoreOutputs) -> list[EngineCoreOutput]:
    """Every output of the step in batch order, the plain one-token columns (``out.new_tokens``) as records too."""
    records = list(out.outputs)
    if out.new_tokens is not None:
        records += [EngineCoreOutput(r, [t]) for r, t in zip(out.new_tokens.request_ids, out.new_tokens.token_ids)]
    order = {req_id: i for i, req_id in enumerate(so.num_scheduled_tokens)}
    return sorted(records, key=lambda o: order[o.request_id])
