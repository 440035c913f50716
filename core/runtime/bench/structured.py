"""``runtime bench throughput --structured-output json``: the cost of constraining outputs.

The same requests run twice in one engine: first each constrained by one of a fixed set of
JSON schemas (greedy, until the grammar completes or ``--output-len``'s maximum), then free,
each with exactly as many output tokens as its constrained run produced (``ignore_eos``), so
both runs compute the same tokens and the difference is the structured-output machinery:
grammar advance, bitmask fill and masking (neither run detokenizes; the constrained outputs
are decoded after the clock stops, to count those that parse). Compile time is measured per schema, cold, with
the engine's own guided backend. The peer is transformers ``generate`` with a logits
processor on the same outlines-core grammars (padded batches, greedy).
"""

from __future__ import annotations

import json
import statistics
import time

# Bounded strings and arrays: even a random model's output completes within a few hundred tokens.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"enum": ["FR", "DE", "JP", "BR"]},
                                      "population": {"type": "integer"}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
                                               "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}, "event": {"type": "string", "maxLength": 24}},
     "required": ["date", "event"]},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
     "required": ["sku", "qty"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                                                              "required": ["x", "y"]}, "minItems": 1, "maxItems": 2}},
     "required": ["points"]},
]


def schema_specs() -> list[str]:
    return [json.dumps(s, sort_keys=True, separators=(",", ":")) for s in SCHEMAS]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def compile_times(llm) -> list[float]:
    """Seconds to compile each schema once, cold, with the engine's guided backend."""
    from runtime.structured_output import GuidedKind

    manager = llm.llm_engine.engine_core.structured_output
    if manager is None:
        raise ValueError("--structured-output needs a guided decoding backend: install runtime-plugin-outlines")
    backend = manager._get_backend()  # built (vocabulary read) before the clock starts
    times = []
    for spec in schema_specs():
        start = time.perf_counter()
        backend.compile(GuidedKind.JSON, spec)
        times.append(time.perf_counter() - start)
    return times


def run_runtime_structured(args, workload, llm_kwargs: dict, rounds: int = 2, min_seconds: float = 5.0,
                           max_rounds: int = 10) -> dict:
    """The constrained workload once untimed (it warms the engine up and gives each request's
    length), then at least ``rounds`` of constrained and free runs in turn, more (up to
    ``max_rounds``) until each side has run ``min_seconds`` (runs of a fraction of a second vary
    by tens of percent on a GPU); returns mean timings, lengths and compile times.

    Measured in turn, not first-then-second: the first full-size run of a process pays one-time
    costs (allocations, kernels compiled for new shapes) that would otherwise land on whichever
    run comes first.
    """
    from runtime import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(**llm_kwargs)
    times = compile_times(llm)
    max_tokens = max(workload.output_lens)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    # Both runs skip incremental detokenization: they differ only by the constraint. The
    # constrained outputs are decoded after the clock stops, to count the valid ones.
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, constrained, use_tqdm=not args.quiet)  # warm-up
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    tokenizer = llm.get_tokenizer()
    valid = sum(_is_json_object(tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)) for o in outputs)
    # Each free run generates exactly as many tokens per request as the constrained run before it.
    # (Greedy constrained outputs may differ between runs where batch composition changes the
    # low bits of the logits, as bfloat16 on a GPU does: the lengths are taken per round.)
    timings: dict[str, list[float]] = {"constrained": [], "free": []}
    tokens: dict[str, list[int]] = {"constrained": [], "free": []}
    while len(timings["free"]) < rounds or (
        len(timings["free"]) < max_rounds and min(sum(timings["free"]), sum(timings["constrained"])) < min_seconds
    ):
        start = time.perf_counter()
        run = llm.generate(prompts, constrained, use_tqdm=not args.quiet)
        timings["constrained"].append(time.perf_counter() - start)
        round_lengths = [len(o.outputs[0].token_ids) for o in run]
        free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in round_lengths]
        start = time.perf_counter()
        run = llm.generate(prompts, free, use_tqdm=not args.quiet)
        timings["free"].append(time.perf_counter() - start)
        if [len(o.outputs[0].token_ids) for o in run] != round_lengths:
            raise RuntimeError("the unconstrained run did not generate the constrained run's lengths")
        tokens["constrained"].append(sum(round_lengths))
        tokens["free"].append(sum(round_lengths))
    steps_ahead = llm.llm_engine.engine_core.num_steps_ahead  # > 0: --async-scheduling reached the engine
    return {"constrained_s": statistics.fmean(timings["constrained"]), "free_s": statistics.fmean(timings["free"]),
            "constrained_tps": sum(tokens["constrained"]) / sum(timings["constrained"]),
            "free_tps": sum(tokens["free"]) / sum(timings["free"]),
            "rounds": timings, "round_tokens": tokens["free"], "lengths": lengths, "valid": valid,
            "compile_s": times, "num_steps_ahead": steps_ahead}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def run_hf_structured(args, workload, hf_model, tokenizer, lengths: list[int]) -> float:
    """transformers ``generate`` (left-padded batches of ``--hf-batch-size``), each row masked by
    its own outlines-core grammar through a logits processor."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from runtime.plugins import get_registry
    from runtime.sample.bitmask import apply_token_bitmask
    from runtime.structured_output import GuidedKind, allocate_token_bitmask

    backend = get_registry("guided_backend").create("outlines", tokenizer, hf_model.config.vocab_size)
    compiled = {spec: backend.compile(GuidedKind.JSON, spec) for spec in schema_specs()}
    specs = schema_specs()

    class GrammarProcessor(LogitsProcessor):
        def __init__(self, grammars, prompt_width):
            self.grammars, self.width = grammars, prompt_width

        def __call__(self, input_ids, scores):
            bitmask = allocate_token_bitmask(len(self.grammars), scores.shape[1])
            if input_ids.shape[1] > self.width:  # advance on the token chosen last step
                for row, grammar in enumerate(self.grammars):
                    token = int(input_ids[row, -1])
                    if not grammar.is_terminated():
                        grammar.accept_tokens([token])
            for row, grammar in enumerate(self.grammars):
                if grammar.is_terminated():  # complete: only EOS, so generate ends the row
                    bitmask[row] = 0
                    word, bit = divmod(eos, 32)
                    bitmask[row, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)
                else:
                    grammar.fill_bitmask(bitmask, row)
            return apply_token_bitmask(scores, bitmask)

    eos = tokenizer.eos_token_id
    hf_model.generation_config.eos_token_id = eos
    pad = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(workload.prompts), args.hf_batch_size):
            prompts = workload.prompts[lo : lo + args.hf_batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf_model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf_model.device)
            grammars = [compiled[specs[(lo + i) % len(specs)]].fork() for i in range(len(prompts))]
            hf_model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                max_new_tokens=max(lengths[lo : lo + len(prompts)]),
                logits_processor=LogitsProcessorList([GrammarProcessor(grammars, width)]),
            )
    return time.perf_counter() - start


def print_report(result: dict, hf_s: float | None, num_requests: int) -> None:
    tokens = sum(result["lengths"])
    constrained_tps, free_tps = result["constrained_tps"], result["free_tps"]
    times = result["compile_s"]
    print(f"\nstructured output (json, {len(SCHEMAS)} schemas): {num_requests} requests, {tokens} output tokens, "
          f"{result['valid']}/{num_requests} outputs parse as JSON objects")
    print(f"{'run':<22} {'time s':>8} {'output tok/s':>13}")
    print(f"{'runtime json':<22} {result['constrained_s']:>8.2f} {constrained_tps:>13.1f}")
    print(f"{'runtime unconstrained':<22} {result['free_s']:>8.2f} {free_tps:>13.1f}")
    if hf_s is not None:
        print(f"{'transformers json':<22} {hf_s:>8.2f} {tokens / hf_s:>13.1f}")
    print(f"constrained / unconstrained: {constrained_tps / free_tps:.1%} (throughput over {len(result['rounds']['free'])} "
          f"rounds after a warm-up run; constrained {', '.join(f'{t:.2f}' for t in result['rounds']['constrained'])}, "
          f"free {', '.join(f'{t:.2f}' for t in result['rounds']['free'])})")
    print(f"schema compile s: p50 {statistics.median(times):.3f}  p99 {percentile(times, 99):.3f}  max {max(times):.3f}")
