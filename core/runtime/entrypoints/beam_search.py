"""vLLM's offline ``LLM.beam_search``: beams grown one token per engine pass.

Each pass asks the engine for one token with the top ``2 * beam_width`` logprobs of every live beam; each
beam's candidates extend it, a candidate ending in EOS is complete (unless ``ignore_eos``), and the best
``beam_width`` of the rest live on. A beam is ranked by ``cum_logprob / len(tokens) ** length_penalty``,
its length counting the prompt and not a final EOS, as vLLM ranks them. ``tokens`` and ``text`` hold the
prompt and the continuation, as in vLLM; the text leaves a final EOS out unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer of at least 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    logprobs: list[dict[int, Any]] = field(default_factory=list)  # per generated token: token id -> Logprob
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


def run_beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    width = params.beam_width
    eos = frozenset(engine.config.model_config.eos_token_ids)
    max_model_len = engine.config.model_config.max_model_len
    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    live: list[list[BeamSearchSequence]] = []
    done: list[list[BeamSearchSequence]] = []
    for prompt in prompts:
        ids, _ = engine.input_processor.tokenize(prompt)
        live.append([BeamSearchSequence(tokens=list(ids))])
        done.append([])

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        for beams, finished in zip(live, done):  # no room for another token: the beam is complete
            for beam in [b for b in beams if len(b.tokens) + 1 >= max_model_len]:
                beam.finish_reason = "length"
                finished.append(beam)
                beams.remove(beam)
        batch = [beam for beams in live for beam in beams]
        if not batch:
            break
        outputs = llm.generate([{"prompt_token_ids": b.tokens} for b in batch], step_params, use_tqdm=False)
        position = 0
        for i, beams in enumerate(live):
            candidates = []
            for beam in beams:
                top = outputs[position].outputs[0].logprobs[0]
                position += 1
                for token, logprob in top.items():
                    grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                               beam.cum_logprob + logprob.logprob)
                    if token in eos and not params.ignore_eos:
                        grown.finish_reason = "stop"
                        done[i].append(grown)
                    else:
                        candidates.append(grown)
            live[i] = sorted(candidates, key=score, reverse=True)[:width]

    tokenizer = llm.get_tokenizer()
    results = []
    for beams, finished in zip(live, done):
        for beam in beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(finished + beams, key=score, reverse=True)[:width]
        if tokenizer is not None:
            for beam in best:
                ends_in_eos = beam.finish_reason == "stop" and not params.include_stop_str_in_output
                beam.text = tokenizer.decode(beam.tokens[:-1] if ends_in_eos else beam.tokens)
        results.append(BeamSearchOutput(sequences=best))
    return results
