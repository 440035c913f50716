"""A launched step whose sampled tokens are still on their way from the device."""

from __future__ import annotations

from runtime.messages import ModelRunnerOutput


class PendingOutput:
    """``result()`` waits for the step's sampled ids, records them in the input batch
    and returns the step's :class:`ModelRunnerOutput` (once; later calls return it again)."""

    def __init__(self, batch, states, req_ids, rows, download, logprobs, prompt_logprobs):
        self.batch = batch
        self.states = states
        self.req_ids = req_ids
        self.rows = rows  # the requests' rows in the input batch, and their generation now
        self.generations = batch.generation[rows] if batch is not None else None
        self.download = download
        self.logprobs = logprobs  # LogprobsTensors on the device, or None
        self.prompt_logprobs = prompt_logprobs
        self.output: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "PendingOutput":
        pending = cls(None, [], output.req_ids, None, None, None, output.prompt_logprobs)
        pending.output = output
        return pending

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self.output is not None or self.download.ready()

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            host = self.download.wait()
            self.batch.receive_tokens(self.rows, self.generations, host.numpy())
            token_ids = host.tolist()
            logprobs = None
            if self.logprobs is not None:
                from runtime.sample.logprobs import to_lists

                logprobs = to_lists(self.logprobs, [s.sampling_params.logprobs or 0 for s in self.states])
            self.output = ModelRunnerOutput(self.req_ids, [[t] for t in token_ids], logprobs, self.prompt_logprobs)
        return self.output
