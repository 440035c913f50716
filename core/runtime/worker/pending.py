"""A launched step whose sampled tokens are still on their way from the device."""

from __future__ import annotations

from runtime.messages import ModelRunnerOutput


class PendingOutput:
    """``result()`` waits for the step's sampled ids, records them in the input batch
    and returns the step's :class:`ModelRunnerOutput` (once; later calls return it again)."""

    def __init__(self, batch, states, download, logprobs, prompt_logprobs):
        self.batch = batch
        self.states = states
        self.download = download
        self.logprobs = logprobs  # LogprobsTensors on the device, or None
        self.prompt_logprobs = prompt_logprobs
        self.output: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "PendingOutput":
        pending = cls(None, [], None, None, output.prompt_logprobs)
        pending.output = output
        return pending

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            token_ids = self.download.wait()
            self.batch.receive_tokens(self.states, token_ids)
            logprobs = None
            if self.logprobs is not None:
                from runtime.sample.logprobs import to_lists

                logprobs = to_lists(self.logprobs, [s.sampling_params.logprobs or 0 for s in self.states])
            self.output = ModelRunnerOutput(
                [s.req_id for s in self.states], [[t] for t in token_ids], logprobs, self.prompt_logprobs
            )
        return self.output
