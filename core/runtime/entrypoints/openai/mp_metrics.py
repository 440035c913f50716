"""The server's metrics when several API processes serve (``--api-server-count`` > 1).

prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before it is
imported): every process writes its samples to files in that folder, and /metrics,
whichever process answers it, renders them all, counters and histograms summed (each
request's in the process that served it; the engine's step counts, such as the tokens
per step and the preemptions, in the one that gets its scheduler stats). The engine's
gauges (running, waiting, KV cache usage, per ``engine`` label too) are set by the process
the engine sends its scheduler stats to; the others leave them at 0, so the maximum over
the live processes is the engine's value.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from runtime.metrics import EngineMetrics


class MultiProcessMetrics(EngineMetrics):
    """EngineMetrics over the shared folder ``metrics_dir``; ``render`` shows every process's samples."""

    def __init__(self, model_name: str, metrics_dir: str):
        self.metrics_dir = metrics_dir
        super().__init__(model_name)

    def _metric(self, kind, name: str, doc: str, extra_labels=(), vllm_names=None, **kwargs):
        if kind is Gauge:
            kwargs.setdefault("multiprocess_mode", "livemax")
        return super()._metric(kind, name, doc, extra_labels, vllm_names, **kwargs)

    def render(self) -> bytes:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.metrics_dir)
        return generate_latest(registry)
