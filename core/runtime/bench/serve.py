"""Online serving benchmark against a running OpenAI-compatible server (``vllm bench serve``'s shape).

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at
once; ``--burstiness`` other than 1 gives gamma-distributed gaps), at most
``--max-concurrency`` in flight. Every request streams; per request it records
time to first token (TTFT), the gaps between streamed chunks (ITL), time per
output token after the first (TPOT) and end-to-end latency (E2EL). Prompts come
from random token ids or a ShareGPT-style JSON file.

    runtime bench serve --base-url http://127.0.0.1:8000 --num-prompts 100 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ENDPOINT_BY_PATH = {path: name for name, path in ENDPOINTS.items()}  # vLLM's --endpoint spelling: the path


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


# ------------------------------------------------------------------ datasets
def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts of random token ids, lengths uniform in ``len * [1 - ratio, 1 + ratio]``."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    low_id = min(100, vocab // 2)  # skip ids that are often special tokens

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        ids = [rng.randrange(low_id, vocab) for _ in range(length(input_len))]
        requests.append(BenchRequest(ids, len(ids), length(output_len)))
    return requests


def sharegpt_requests(path: str, tokenizer, num: int, fixed_output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as the output length."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in (data if isinstance(data, list) else ())
        if isinstance(d, dict) and len(d.get("conversations", [])) >= 2
    ]
    if not pairs:
        raise ValueError(f"{path} holds no ShareGPT conversations (a list of {{'conversations': [human, gpt, ...]}})")
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        output_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or output_len < 4:
            continue  # too short to measure, as vLLM filters
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path} holds no conversation long enough to measure (prompt and reply of 4+ tokens)")
    return requests


def random_id_requests(args) -> list[BenchRequest]:
    """``runtime bench throughput``'s workload for the same lengths and seed: no tokenizer needed."""
    from runtime.bench.throughput import make_workload, parse_range

    if args.endpoint != "completions":
        raise ValueError("--dataset-name random-ids sends token-id prompts: it needs --endpoint completions")
    vocab = args.vocab_size or _served_vocab_size(args)
    workload = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab, args.seed)
    return [BenchRequest(p, len(p), n) for p, n in zip(workload.prompts, workload.output_lens)]


def _served_vocab_size(args) -> int:
    root = args.model_root
    config = os.path.join(root or "", "config.json")
    if not root or not os.path.isfile(config):
        raise ValueError(f"--dataset-name random-ids needs --vocab-size (the served model {root!r} has no config.json here)")
    with open(config) as f:
        data = json.load(f)
    return int(data.get("vocab_size") or data["text_config"]["vocab_size"])


# ------------------------------------------------------------------ requests
def request_body(args, request: BenchRequest, tokenizer) -> dict:
    body = {"model": args.model, "max_tokens": request.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    if args.dataset_name == "random-ids":
        body["return_token_ids"] = True
    if args.endpoint == "chat":
        text = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(request.prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = request.prompt
    return body


async def send_request(http, url: str, body: dict, prompt_len: int) -> RequestResult:
    """Stream one request; the clock runs from sending it to the ``[DONE]`` event."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = data["error"].get("message", str(data["error"]))
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not any(_chunk_text(c) or c.get("token_ids") for c in data.get("choices", ())):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or num_chunks
        result.success = num_chunks > 0
        result.error = "" if result.success else "no tokens streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def run_requests(args, requests: list[BenchRequest], tokenizer) -> tuple[list[RequestResult], float]:
    import httpx

    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests), max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None), limits=limits) as http:
        warm = await send_request(http, url, {**request_body(args, requests[0], tokenizer), "max_tokens": 2}, 0)
        if not warm.success:
            raise ValueError(f"the test request to {url} failed: {warm.error}")
        progress = None if args.disable_tqdm else _progress_bar(len(requests))

        async def limited(request: BenchRequest) -> RequestResult:
            body = request_body(args, request, tokenizer)
            if semaphore is None:
                result = await send_request(http, url, body, request.prompt_len)
            else:
                async with semaphore:
                    result = await send_request(http, url, body, request.prompt_len)
            if progress is not None:
                progress.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for request in requests:
            tasks.append(asyncio.create_task(limited(request)))
            if args.request_rate != float("inf"):
                # Gamma gaps with mean 1/rate; burstiness 1 is a Poisson process.
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(float(rng.gamma(args.burstiness, theta)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if progress is not None:
            progress.close()
        return results, duration


def _progress_bar(total: int):
    """Requests done so far, on stderr (vLLM's bench serve shows the same; --disable-tqdm hides it)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")


# ------------------------------------------------------------------- report
def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in samples.items():
        ms = np.array(values or [0.0]) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def print_summary(summary: dict, percentiles: list[float]) -> None:
    line = "=" * 50
    print(f"{line}\n{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        print(f"{' ' + title + ' ':-^50}")
        for stat in ["mean", "median"] + [f"p{p:g}" for p in percentiles]:
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms):"
            print(f"{label:<40}{summary[f'{stat}_{name}_ms']:<10.2f}")
    print(line)


# ---------------------------------------------------------------------- CLI
def register(sub) -> None:
    parser = sub.add_parser("serve", help="online serving benchmark against a running server")
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions", type=lambda v: _ENDPOINT_BY_PATH.get(v, v))
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the served model's path)")
    parser.add_argument("--api-key", default=os.environ.get("RUNTIME_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset-name", choices=("random", "random-ids", "sharegpt"), default="random",
                        help="random: random token ids (tokenizer for the vocab); random-ids: runtime bench "
                             "throughput's prompts, no tokenizer; sharegpt: --dataset-path")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON file")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary by up to this fraction")
    parser.add_argument("--input-len", default="128", help="random-ids: prompt length range MIN,MAX")
    parser.add_argument("--output-len", default="64", help="random-ids: output length range MIN,MAX")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random-ids: token ids below this (default: the served model's config.json)")
    parser.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for ShareGPT")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar of the requests done")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-filename", default=None, help="JSON file for --save-result")


def check_arguments(args) -> None:
    """Bad numbers and missing files fail here, before the server is asked anything; ValueError naming the value."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be >= 1, "
                         f"got {args.random_input_len} and {args.random_output_len}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {args.request_rate} and {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.dataset_name == "random-ids":
        from runtime.bench.throughput import parse_range

        parse_range(args.input_len), parse_range(args.output_len)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        if not os.path.isfile(args.dataset_path):
            raise ValueError(f"--dataset-path {args.dataset_path!r} is not a file")
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {args.metric_percentiles!r}") from None
    if not all(0 <= p <= 100 for p in args.percentiles):
        raise ValueError(f"--metric-percentiles must be in 0..100, got {args.metric_percentiles!r}")


def _served_model(args) -> tuple[str, str | None]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"no server answers at {args.base_url} ({type(exc).__name__}: {exc}); "
                         "start one with `runtime serve` or pass --base-url / --host / --port") from None
    if response.status_code != 200:
        raise ValueError(f"GET {url} answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        models = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"GET {url} did not answer an OpenAI model list: {response.text[:200]!r}") from None
    if not models:
        raise ValueError(f"the server at {args.base_url} serves no model")
    return models[0]["id"], models[0].get("root")


def _load_tokenizer(path: str):
    from runtime.model_loader import get_tokenizer, resolve_model

    return get_tokenizer(resolve_model(path, tokenizer=None))


def main(args) -> int:
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    check_arguments(args)
    name, args.model_root = _served_model(args)
    args.model = args.model or name
    tokenizer = None
    if args.dataset_name != "random-ids":
        tokenizer = _load_tokenizer(args.tokenizer or args.model_root)
    if args.dataset_name == "random-ids":
        requests = random_id_requests(args)
    elif args.dataset_name == "sharegpt":
        requests = sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed)
    else:
        requests = random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, args.seed)
    percentiles = args.percentiles
    print(f"{len(requests)} requests to {args.base_url} ({args.endpoint}), rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency}")
    results, duration = asyncio.run(run_requests(args, requests, tokenizer))
    summary = summarize(results, duration, percentiles)
    print_summary(summary, percentiles)
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        print("errors:", *errors[:5], sep="\n  ")
    if args.save_result:
        filename = args.result_filename or f"serve-{os.path.basename(os.path.normpath(args.model))}-{int(time.time())}.json"
        record = {**summary, "model": args.model, "endpoint": args.endpoint, "request_rate": args.request_rate,
                  "max_concurrency": args.max_concurrency, "num_prompts": len(requests),
                  "results": [asdict(r) for r in results]}
        with open(filename, "w") as f:
            json.dump(record, f, indent=2)
        print(f"results written to {filename}")
    return 0 if summary["completed"] else 1
