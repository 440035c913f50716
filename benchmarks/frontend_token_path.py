"""Where one output token's time goes in the serving front end (issue 20).

Starts ``runtime serve``, drives it with ``runtime bench serve`` (token-id prompts, all
streams at once), and reports the CPU seconds per output token of the API process(es) and
of the engine process (from /proc, so it holds on a shared machine), plus, with
``--profile``, how the API processes' busy time splits by stage (py-spy samples taken
during the benchmark only, attributed to the innermost frame).

    python benchmarks/frontend_token_path.py --model /tmp/tiny_llama --num-prompts 256 \\
        --output-len 64 --profile -- --dtype float32 --max-num-seqs 256

Arguments after ``--`` go to ``runtime serve``. ``--pythonpath`` runs another checkout's code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import httpx

STAGES = [  # (stage, path fragments of the functions whose own time it sums), first match wins
    ("request setup (worker threads: tokenize, validate)", ("input_processor.py", "prompt_inputs.py", "protocol.py")),
    ("engine link: ZMQ receive, msgpack decode", ("core_client.py", "/zmq/", "msgspec")),
    ("detokenize (tokenizer.decode)", ("detokenizer.py", "tokenizers", "tokenization_utils", "transformers/utils/generic")),
    ("output processor: request states, outputs", ("output_processor.py", "request_state.py", "logprobs.py",
                                                   "parent_request.py", "coalesce.py", "outputs.py")),
    ("routing to request queues, metrics", ("async_llm.py", "metrics.py", "stat_logger.py", "prometheus_client",
                                            "asyncio/queues.py")),
    ("OpenAI chunks: build, JSON encode", ("serving_", "responses.py", "json/", "pydantic")),
    ("HTTP: starlette, uvicorn, SSE send", ("starlette", "uvicorn", "fastapi", "h11", "httptools", "middleware.py",
                                           "api_server.py")),
    ("event loop, tasks, sockets", ("asyncio", "uvloop", "selectors", "socket", "<built-in method select", "~")),
]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stage_breakdown(paths: list[str]) -> list[tuple[str, int]]:
    """Samples per stage from py-spy's raw (collapsed) stacks: ``frame;frame;... count`` per line.

    A sample counts for the innermost frame that belongs to a stage; idle pool threads are left out."""
    totals: dict[str, int] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                if frames[-1].startswith("_worker (concurrent/futures/thread.py"):
                    continue  # a to_thread worker waiting for work
                stage = next((s for frame in reversed(frames) for s, parts in STAGES
                              if any(p in frame for p in parts)), "other")
                totals[stage] = totals.get(stage, 0) + int(count)
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8477)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="32,64")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None, help="for a model without config.json (GGUF)")
    parser.add_argument("--profile", action="store_true", help="sample the API processes with py-spy")
    parser.add_argument("--pythonpath", default=None, help="run the server from this checkout's core/")
    args, serve_flags = parser.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    cmd = [sys.executable, "-m", "runtime.cli.main", "serve", args.model, "--port", str(args.port),
                    "--disable-log-requests", *serve_flags]
    log = open(f"/tmp/frontend_token_path_{args.port}.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        time.sleep(3)  # every API process up
        text = open(log.name).read()
        engine_pid = int(re.search(r"engine core process started \(pid (\d+)\)", text).group(1))
        several = re.search(r"API server processes \(pids ([\d, ]+)\)", text)
        api_pids = [int(p) for p in several.group(1).split(", ")] if several else [server.pid]
        procs = sorted({server.pid, engine_pid, *api_pids})
        spies = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o",
                                   f"/tmp/ftp_{pid}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for pid in api_pids] if args.profile else []
        before = {pid: cpu_seconds(pid) for pid in procs}
        bench = [sys.executable, "-m", "runtime.cli.main", "bench", "serve", "--base-url", url,
                 "--dataset-name", "random-ids", "--input-len", args.input_len, "--output-len", args.output_len,
                 "--num-prompts", str(args.num_prompts), "--save-result", "--result-filename", "/tmp/ftp.json"]
        if args.max_concurrency:
            bench += ["--max-concurrency", str(args.max_concurrency)]
        if args.vocab_size:
            bench += ["--vocab-size", str(args.vocab_size)]
        client_before = os.times()
        out = subprocess.run(bench, capture_output=True, text=True)
        client_after = os.times()
        print(out.stdout[-2500:], out.stderr[-2000:])
        after = {pid: cpu_seconds(pid) for pid in procs}
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        tokens = int(re.search(r"Total generated tokens:\s+(\d+)", out.stdout).group(1))
        for pid in procs:
            role = "engine" if pid == engine_pid else "API" if pid in api_pids else "parent"
            print(f"{role} pid {pid}: {after[pid] - before[pid]:.2f} CPU s, "
                  f"{(after[pid] - before[pid]) / tokens * 1e6:.1f} us per output token")
        client = sum(client_after[i] - client_before[i] for i in (2, 3))  # children's user + system
        print(f"client (runtime bench serve): {client:.2f} CPU s, {client / tokens * 1e6:.1f} us per output token")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(120)
    if args.profile:
        stages = stage_breakdown([f"/tmp/ftp_{pid}.txt" for pid in api_pids])
        total = sum(n for _, n in stages)
        print(f"API processes, {total} busy samples (py-spy, innermost frame):")
        for stage, num in stages:
            print(f"  {stage:<45} {100 * num / total:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
