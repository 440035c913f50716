"""GPU: the one-shot all-reduce against NCCL per message size, inside CUDA graphs, on 2 (4, 8) GPUs.

One process per GPU (NCCL process group). For each size and each path a graph of ``--calls``
back-to-back all-reduces of one buffer is captured (a decode step of the 8B model at TP=2 makes
65: two per layer and the embedding's), replayed ``--replays`` times after a warm-up, and timed
with CUDA events on every rank; the slowest rank's mean per call is reported. Prints a table,
the largest size up to which one-shot wins at every size (the value to give
``RUNTIME_CUDA_ONE_SHOT_MAX_BYTES``), and with ``--json`` writes the numbers.

    python hardware/cuda/bench/allreduce.py [--world 2] [--dtype bfloat16] [--max-blocks 36[,16,...]] [--modes push,pull]
        [--json out.json]

``--modes``: ``push`` (each rank stores its message in every rank's workspace, the sum reads local
memory) and ``pull`` (each rank stores in its own, the sum reads the peers'); a column per mode and
``--max-blocks`` value.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

KIB = 1024
DEFAULT_SIZES = [4 * KIB << i for i in range(12)]  # 4 KiB .. 8 MiB


def time_graph(step, calls: int, replays: int) -> float:
    """Mean microseconds per call of ``step`` captured ``calls`` times in one graph."""
    import torch.distributed as dist

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def rank_main(rank: int, world: int, init_file: str, args, out_file: str) -> None:
    import torch.distributed as dist

    from runtime_cuda.one_shot import OneShotAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    reducers = {}
    for mode in args.modes:
        for max_blocks in args.max_blocks:
            reduce, reason = OneShotAllReduce.create(dist.group.WORLD, max(args.sizes), max_blocks, push=mode == "push")
            if reduce is None:
                raise SystemExit(f"no one-shot all-reduce: {reason}")
            reducers[f"{mode}/{max_blocks}"] = reduce
    rows = []
    for nbytes in args.sizes:
        buf = torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device="cuda")
        times = {"nccl": time_graph(lambda: dist.all_reduce(buf), args.calls, args.replays)}
        for name, reduce in reducers.items():
            times[name] = time_graph(lambda: reduce(buf), args.calls, args.replays)
        slowest = [None] * world
        dist.all_gather_object(slowest, times)
        rows.append({"bytes": nbytes, **{k: max(t[k] for t in slowest) for k in times}})
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    torch.cuda.synchronize()
    for reduce in reducers.values():
        reduce.close()
    dist.barrier()
    dist.destroy_process_group()


def crossover(rows: list[dict], name: str) -> int:
    """The largest size up to which ``name`` beats NCCL at every measured size (0: never)."""
    best = 0
    for row in rows:
        if row[name] >= row["nccl"]:
            break
        best = row["bytes"]
    return best


def report(rows: list[dict], names: list[str]) -> str:
    lines = [f"{'bytes':>10} {'nccl us':>9} " + " ".join(f"{n + ' us':>15}" for n in names)]
    for row in rows:
        lines.append(f"{row['bytes']:>10} {row['nccl']:>9.2f} " + " ".join(f"{row[n]:>15.2f}" for n in names))
    for name in names:
        lines.append(f"{name}: faster than NCCL at every size up to {crossover(rows, name)} bytes")
    best = max(names, key=lambda n: crossover(rows, n))
    lines.append(f"suggested RUNTIME_CUDA_ONE_SHOT_MAX_BYTES={crossover(rows, best)} ({best})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES)
    parser.add_argument("--max-blocks", type=lambda s: [int(x) for x in s.split(",")], default=[36])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["push", "pull"])
    parser.add_argument("--calls", type=int, default=65, help="all-reduces per captured graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        procs = [ctx.Process(target=rank_main, args=(r, args.world, os.path.join(tmp, "init"), args, out_file))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        with open(out_file) as f:
            rows = json.load(f)
    names = [f"{m}/{b}" for m in args.modes for b in args.max_blocks]
    print(f"all-reduce of {args.dtype} on {args.world} GPUs ({torch.cuda.get_device_name(0)}), "
          f"{args.calls} calls per graph, {args.replays} replays, slowest rank's mean per call:")
    print(report(rows, names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "world": args.world, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
