"""What the megakernel benchmarks share: random FP8 weights, a step captured in one CUDA graph and timed over its
replays, the relative difference, the waits report."""
import torch


def captured(step):
    """``step`` run once, then captured in a CUDA graph and replayed once (its outputs are then the graph's)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph, rounds: int = 7, replays: int = 20) -> float:
    """The median over ``rounds`` of ms a replay, ``replays`` replays a round."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[rounds // 2]


def rel(out, ref) -> float:
    """The largest difference, relative to the reference's largest value."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fp8_weights(device, layers: int, shapes):
    """Random FP8 weights [layers, n, k] and float32 row scales [layers, n] for each (name, n, k) of ``shapes``,
    scaled so that a GEMV of a unit-variance x gives about unit-variance rows."""
    weights, scales = {}, {}
    for name, n, k in shapes:
        weights[name] = (torch.randn(layers, n, k, device=device) * 0.3).to(torch.float8_e4m3fn)
        scales[name] = (torch.rand(layers, n, device=device) * 0.2 + 0.9) / (0.3 * k ** 0.5)
    return weights, scales


def print_waits(waits, blocks: int) -> None:
    """A persistent kernel's waits ([blocks][2] ns: its consumers', its stagers'), µs a step."""
    wt = waits.view(blocks, 2).double() / 1e3
    print(f"|   waits, µs a step: consumers for staged chunks mean {wt[:, 0].mean():.1f} max {wt[:, 0].max():.1f}; "
          f"stagers for their chunks mean {wt[:, 1].mean():.1f} |", flush=True)
