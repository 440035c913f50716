"""The engine's Prometheus metrics as objects, for ``LLM.get_metrics()`` (vLLM's ``vllm.v1.metrics.reader``).

Each metric family of the registry becomes one object per label set: a :class:`Counter` (``value``, the
``_total`` sample), a :class:`Gauge` (``value``), a :class:`Histogram` (``count``, ``sum`` and ``buckets``,
cumulative counts keyed by the ``le`` bound as Prometheus writes it, ``"+Inf"`` last), and, for a counter
labelled by ``position`` (speculative decoding's accepted tokens per draft position), a :class:`Vector`
whose ``values`` are the counts by position. Names are as /metrics shows them: ``vllm:...`` and ``runtime:...``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

VECTOR_LABEL = "position"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int | float


@dataclass
class Vector(Metric):
    values: list[int | float]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _key(labels: dict[str, str], *drop: str) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of ``registry`` now, in the registry's order."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            metrics.extend(_counters(family))
        elif family.type == "gauge":
            metrics.extend(Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples)
        elif family.type == "histogram":
            metrics.extend(_histograms(family))
    return metrics


def _counters(family) -> list[Metric]:
    totals = [s for s in family.samples if s.name == family.name + "_total"]
    if not any(VECTOR_LABEL in s.labels for s in totals):
        return [Counter(family.name, dict(s.labels), _number(s.value)) for s in totals]
    vectors: dict[tuple, dict[int, float]] = {}
    for s in totals:
        vectors.setdefault(_key(s.labels, VECTOR_LABEL), {})[int(s.labels[VECTOR_LABEL])] = s.value
    result: list[Metric] = []
    for key, by_position in vectors.items():
        values = [0] * (max(by_position) + 1)
        for position, value in by_position.items():
            values[position] = _number(value)
        result.append(Vector(family.name, dict(key), values))
    return result


def _histograms(family) -> list[Metric]:
    parts: dict[tuple, dict] = {}
    for s in family.samples:
        entry = parts.setdefault(_key(s.labels, "le"), {"buckets": {}, "count": 0, "sum": 0.0})
        if s.name == family.name + "_bucket":
            entry["buckets"][s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            entry["count"] = int(s.value)
        elif s.name == family.name + "_sum":
            entry["sum"] = float(s.value)
    return [Histogram(family.name, dict(key), e["count"], e["sum"], e["buckets"]) for key, e in parts.items()]
