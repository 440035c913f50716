"""``runtime bench ...``: benchmarks shipped with the engine."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("bench", help="run a benchmark")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    from runtime.bench import latency, multi_turn, serve, step_overhead, throughput

    throughput.register(bench_sub)
    step_overhead.register(bench_sub)
    serve.register(bench_sub)
    latency.register(bench_sub)
    multi_turn.register(bench_sub)
