"""Multi-turn chat with a shared system prompt: TTFT of later turns with and without KV offload.

``--num-conversations`` conversations of ``--num-turns`` turns share a ``--system-len``-token
system prompt; each turn sends the whole history (system prompt, earlier user turns and
answers) plus ``--user-len`` new tokens and generates ``--output-len`` tokens (greedy, EOS
ignored). Conversations are closed loops, like people chatting: the first turns arrive spread
over one think time, and each next turn arrives ``--think-time`` seconds (on average; uniform in
0.5x..1.5x, seeded) after the previous answer ended. The device pool holds the system prompt and
about ``--pool-conversations`` full histories (``--num-gpu-blocks-override`` sets it directly),
so a conversation that comes back finds its history evicted: without offload it recomputes it,
with the cpu tier it loads it. The same workload runs once per ``--offload-modes`` entry
(``none``, ``cpu``, ``cpu,disk`` ...), the other engine arguments unchanged; the table gives
TTFT p50/p99 of turns 2 and later (from a turn's arrival to its first token), prompt tokens that
came from the device prefix cache and from the offload tiers, and the p50 speed-up over ``none``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass


@dataclass
class MultiTurnResult:
    mode: str
    later_ttfts: list[float]  # seconds, turns 2.. of every conversation
    first_ttfts: list[float]
    cached_tokens: int  # prompt tokens of later turns found cached (device or tiers)
    offload_tokens: int  # of those, loaded from an offload tier
    wall_s: float
    loaded_bytes: int = 0  # over the whole run, the first turns too
    load_seconds: float = 0.0  # from queueing a step's loads until they completed

    def percentile(self, q: float) -> float:
        values = sorted(self.later_ttfts)
        return values[min(len(values) - 1, int(q * len(values)))]


def workload(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt, per conversation its user turns)."""
    rng = random.Random(args.seed)
    low = min(100, vocab // 2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    return tokens(args.system_len), [[tokens(args.user_len) for _ in range(args.num_turns)] for _ in range(args.num_conversations)]


def run_mode(args, mode: str, system: list[int], users: list[list[list[int]]]) -> MultiTurnResult:
    from tqdm import tqdm

    from runtime import SamplingParams
    from runtime.bench.throughput import engine_kwargs
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_args import EngineArgs

    kwargs = engine_kwargs(args)
    kwargs["kv_offload"] = None if mode == "none" else mode
    if mode == "none":  # the same engine without any offload setting
        kwargs.update(kv_offload_size=None, kv_offload_dir=None, kv_offload_policy=None, kv_transfer_config=None,
                      preemption_mode="recompute")
    elif "disk" not in mode:
        kwargs["kv_offload_dir"] = None
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    engine.add_request("warmup", {"prompt_token_ids": users[0][0] * 2}, params)  # first-step costs are not TTFT
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.engine_core.scheduler.stats
    before = stats()
    histories = [list(system) for _ in users]
    rng = random.Random(args.seed + 1)  # the same arrivals and think times in every mode
    offsets = [rng.uniform(0.0, args.think_time) for _ in users]
    thinks = [[args.think_time * rng.uniform(0.5, 1.5) for _ in range(args.num_turns)] for _ in users]
    start_all = time.perf_counter()
    arrivals = [(start_all + offset, i, 0) for i, offset in enumerate(offsets)]  # (time, conversation, turn)
    sent: dict[str, tuple[int, int, float]] = {}
    first, later, cached, ttft_seen = [], [], 0, set()
    progress = tqdm(total=len(users) * args.num_turns, desc=f"turns ({mode})", unit="turn", disable=args.disable_tqdm)
    while arrivals or engine.has_unfinished_requests():
        arrivals.sort()
        now = time.perf_counter()
        while arrivals and arrivals[0][0] <= now:
            _, conv, turn = arrivals.pop(0)
            histories[conv] += users[conv][turn]
            request_id = f"c{conv}t{turn}"
            sent[request_id] = (conv, turn, time.perf_counter())
            engine.add_request(request_id, {"prompt_token_ids": list(histories[conv])}, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[0][0] - time.perf_counter()))
            continue
        for output in engine.step():
            conv, turn, t0 = sent[output.request_id]
            if output.request_id not in ttft_seen and output.outputs[0].token_ids:
                ttft_seen.add(output.request_id)
                (later if turn else first).append(time.perf_counter() - t0)
            if output.finished:
                progress.update(1)
                histories[conv] += list(output.outputs[0].token_ids)
                if turn:
                    cached += output.num_cached_tokens
                if turn + 1 < args.num_turns:
                    arrivals.append((time.perf_counter() + thinks[conv][turn], conv, turn + 1))
    wall = time.perf_counter() - start_all
    progress.close()
    after = stats()
    engine.engine_core.shutdown()

    def delta(key: str):
        return after.get(key, 0) - before.get(key, 0)

    return MultiTurnResult(mode, later, first, cached, delta("kv_offload_hit_tokens"), wall,
                           delta("kv_offload_bytes_loaded"), delta("kv_offload_load_seconds"))


def default_pool(args) -> tuple[int, int]:
    """(max_model_len, device blocks): the last turn's history fits, and the pool holds the system
    prompt with about ``--pool-conversations`` conversations' own turns (fewer than all of them)."""
    own = args.num_turns * (args.user_len + args.output_len)
    max_len = args.max_model_len or args.system_len + own + args.block_size
    blocks = args.num_gpu_blocks_override or -(-(max_len + args.pool_conversations * own) // args.block_size) + 1
    return max_len, blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from runtime.cli.args import add_engine_args

    parser.add_argument("--num-conversations", type=int, default=32)
    parser.add_argument("--num-turns", type=int, default=5)
    parser.add_argument("--system-len", type=int, default=2000, help="tokens of the shared system prompt")
    parser.add_argument("--user-len", type=int, default=64, help="new tokens of each user turn")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--think-time", type=float, default=2.0,
                        help="mean seconds between an answer and the conversation's next turn")
    parser.add_argument("--pool-conversations", type=int, default=2,
                        help="full conversation histories the default device pool holds besides the system prompt")
    parser.add_argument("--offload-modes", default="none,cpu", help="comma-separated runs: none, or --kv-offload values "
                        "(cpu, disk, cpu+disk for cpu,disk)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar of the turns answered")
    add_engine_args(parser)


def register(sub) -> None:
    parser = sub.add_parser("multi-turn", help="TTFT of later chat turns with and without KV offload tiers")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    from runtime.model_loader import resolve_model

    if args.think_time < 0 or args.pool_conversations < 1:
        raise ValueError(f"--think-time must be >= 0 and --pool-conversations >= 1, got {args.think_time}, "
                         f"{args.pool_conversations}")
    if args.num_turns < 2:
        raise ValueError(f"--num-turns must be at least 2 (later turns are measured), got {args.num_turns}")
    if not args.model:
        from runtime.cli.serve import default_model_path

        args.model = default_model_path()
    args.max_model_len, args.num_gpu_blocks_override = default_pool(args)
    vocab = int(resolve_model(args.model).hf_config.vocab_size)
    system, users = workload(args, vocab)
    modes = [m.strip().replace("+", ",") for m in args.offload_modes.split(",") if m.strip()]
    results = [run_mode(args, mode, system, users) for mode in modes]
    base = next((r for r in results if r.mode == "none"), None)
    print(f"\n{args.num_conversations} conversations x {args.num_turns} turns, system prompt {args.system_len}, "
          f"user turns {args.user_len}, answers {args.output_len} tokens, think time {args.think_time}s; device pool {args.num_gpu_blocks_override} "
          f"blocks x {args.block_size}")
    print(f"{'offload':<10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'turn 1 p50':>11} {'cached tok':>11} "
          f"{'from tiers':>11} {'wall s':>8} {'p50 speed-up':>13} {'loaded GB':>10} {'load GB/s':>10}")
    for r in results:
        speedup = f"{base.percentile(0.5) / r.percentile(0.5):.2f}x" if base is not None else "-"
        print(f"{r.mode:<10} {1000 * r.percentile(0.5):>12.1f} {1000 * r.percentile(0.99):>12.1f} "
              f"{1000 * statistics.median(r.first_ttfts):>11.1f} {r.cached_tokens:>11} {r.offload_tokens:>11} "
              f"{r.wall_s:>8.1f} {speedup:>13} {r.loaded_bytes / 1e9:>10.2f} "
              f"{(r.loaded_bytes / 1e9 / r.load_seconds if r.load_seconds else 0.0):>10.1f}")
    return 0
