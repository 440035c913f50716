"""The building blocks of /metrics: vLLM's histogram buckets, one metric under runtime's and vLLM's
names (:class:`Family`), and the per-request timing record that the request histograms are made from."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "runtime:"
VLLM_PREFIX = "vllm:"

# vLLM's bucket bounds (every one of them, so a dashboard's ``le="..."`` query finds its bucket), reaching
# minutes for the first token and hours for a request: a long queue must not fall into +Inf.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
# e2e latency and the request's phases (queue, prefill, decode, inference) share these, as in vLLM.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)  # 1, 2, 5, 10 ...
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


class Group:
    """Several metric children updated together."""

    __slots__ = ("_children",)

    def __init__(self, children):
        self._children = tuple(children)

    def inc(self, amount: float = 1.0) -> None:
        for child in self._children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class Family:
    """One metric: ``runtime:<name>`` for the whole server (labels ``model_name`` + extra) and its vLLM-named
    twins, one series per engine core (labels ``model_name``, ``engine`` + extra), as vLLM labels its series.

    ``server(*extra)``: the runtime series; ``engine(e, *extra)``: engine ``e``'s vLLM series; ``on(e, *extra)``:
    both (an event of engine ``e`` counts for the server and for its engine). Children are looked up once.
    """

    __slots__ = ("_own", "_twins", "_model_name", "_groups")

    def __init__(self, own, twins, model_name: str):
        self._own, self._twins, self._model_name = own, tuple(twins), model_name
        self._groups: dict[tuple, Group] = {}

    def server(self, *extra: str) -> Group:
        return self._group(("server", *extra), lambda: [self._own.labels(self._model_name, *extra)])

    def engine(self, engine: str, *extra: str) -> Group:
        return self._group(("engine", engine, *extra),
                           lambda: [twin.labels(self._model_name, engine, *extra) for twin in self._twins])

    def on(self, engine: str, *extra: str) -> Group:
        return self._group(("on", engine, *extra), lambda: [
            self._own.labels(self._model_name, *extra), *(t.labels(self._model_name, engine, *extra) for t in self._twins)
        ])

    def _group(self, key: tuple, children) -> Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(children())
        return group


@dataclass(slots=True)
class RequestTimes:
    """One engine request's timing, from its arrival to its end.

    ``first_token``/``last_token``: when the front end received them (TTFT, inter-token latency).
    ``queued``/``scheduled``/``first_token_ts``/``last_token_ts``: the engine core's clock (time.time()
    there): when it queued the request, first scheduled it, and sent its first and latest tokens.
    """

    arrival: float
    num_prompt_tokens: int = 0  # 0 for the children of an n > 1 request after the first
    engine: str | None = None  # the engine core (data-parallel rank) serving it, once known
    max_tokens: int | None = None
    parent: str | None = None  # n > 1: the request it was fanned out of
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    queued: float = 0.0
    scheduled: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0

    def phases(self) -> tuple[float, float, float, float] | None:
        """(queue, prefill, decode, inference) seconds, as vLLM defines them; None before the first token.

        Queue: queued to first scheduled. Prefill: first scheduled to first token. Decode: first token to last
        token. Inference: first scheduled to last token. A preemption's wait counts in the phase it fell in.
        """
        if not (self.scheduled and self.first_token_ts):
            return None
        return (
            max(self.scheduled - self.queued, 0.0),
            max(self.first_token_ts - self.scheduled, 0.0),
            max(self.last_token_ts - self.first_token_ts, 0.0),
            max(self.last_token_ts - self.scheduled, 0.0),
        )
