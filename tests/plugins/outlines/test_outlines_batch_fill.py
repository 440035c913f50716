"""The outlines backend's batched bitmask fill and its slots form: every row equals the grammar's
own per-row fill and outlines-core's own ``Guide`` answer, for grammars in random states of many
specs at once (the shared mask table included, also when it fills up and is cleared, and the
device copy of the table that only receives new rows)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from outlines_core import Guide

from runtime.bench.structured import SCHEMAS as BENCH_SCHEMAS
from runtime.sample.bitmask import DeviceMaskTable, apply_token_bitmask, unpack_bitmask
from runtime.structured_output import GuidedKind, allocate_token_bitmask, fill_bitmask_batch
from runtime_outlines.backend import OutlinesBackend
from runtime_outlines.masks import MaskTable

VOCAB = 49152
SPECS = [(GuidedKind.JSON, json.dumps(s)) for s in BENCH_SCHEMAS] + [
    (GuidedKind.REGEX, r"[0-9]{3}-[a-z]+"),
    (GuidedKind.REGEX, "[0-9]+"),
    (GuidedKind.CHOICE, json.dumps(["yes", "no", "maybe (later)"])),
]


def allowed_ids(words: torch.Tensor) -> set[int]:
    """Bit t % 32 of word t // 32 -> the set of allowed token ids."""
    values = words.tolist()
    return {w * 32 + b for w, value in enumerate(values) if value for b in range(32) if (value >> b) & 1}


def random_grammars(backend, rng: random.Random, count: int):
    """``count`` grammars of the specs above, each walked a random number of random allowed
    tokens (some past EOS, some rolled back), with the token list that got it there."""
    compiled = [backend.compile(kind, spec) for kind, spec in SPECS]
    eos = backend.vocab.eos_token_id
    grammars = []
    for i in range(count):
        grammar = compiled[i % len(compiled)].fork()
        for _ in range(rng.randrange(0, 30)):
            if grammar.is_terminated():
                break
            tokens = sorted(replay(grammar).get_tokens())
            if eos in tokens and rng.random() < 0.2:
                token = eos
            else:
                token = rng.choice([t for t in tokens if t != eos] or [eos])
            assert grammar.accept_tokens([token])
        if grammar.num_accepted > 2 and rng.random() < 0.2:
            grammar.rollback(rng.randrange(1, 3))
        grammars.append(grammar)
    return grammars


def replay(grammar) -> Guide:
    """outlines-core's own guide over the grammar's accepted tokens (EOS excluded)."""
    guide = Guide(grammar.compiled.index)
    for token in grammar._tokens:
        guide.advance(token, return_tokens=False)
    return guide


@pytest.mark.parametrize("max_bytes", [None, 40 * 4 * (VOCAB // 32)], ids=["table", "table cleared when full"])
def test_batched_fill_and_slots_equal_per_row_fills_and_outlines_core(smollm2_tokenizer, max_bytes):
    backend = OutlinesBackend(smollm2_tokenizer, VOCAB)
    if max_bytes is not None:  # a table of 40 rows: it fills up and is cleared between fills
        backend.masks = MaskTable(backend.masks.num_words, backend.masks.end_token_id, max_bytes=max_bytes)
    rng = random.Random(0)
    eos = smollm2_tokenizer.eos_token_id
    mirror = DeviceMaskTable("cpu", copy=True)
    for round_ in range(4):
        grammars = random_grammars(backend, rng, 48)
        batch = torch.empty((len(grammars), (VOCAB + 31) // 32), dtype=torch.int32)
        fill_bitmask_batch(backend, grammars, batch)
        per_row = allocate_token_bitmask(len(grammars), VOCAB)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(per_row, row)
        assert torch.equal(batch, per_row)
        slots = backend.bitmask_slots(grammars)
        assert torch.equal(slots.dense(), batch)
        # through a table copy refreshed with new rows only (as on a GPU), also across clears
        masked = apply_token_bitmask(torch.zeros(len(grammars), VOCAB), mirror.sync(slots), slots=slots.slots)
        assert torch.equal(torch.isfinite(masked), unpack_bitmask(batch, VOCAB))
        for row, grammar in enumerate(grammars):
            expected = {eos} if grammar._ended else set(replay(grammar).get_tokens())
            assert allowed_ids(batch[row]) == expected, (round_, row, grammar)
    if max_bytes is not None:
        assert backend.masks.num_resets > 0


def test_batched_fill_needs_the_backends_bitmask_shape(smollm2_backend):
    grammars = [smollm2_backend.compile(GuidedKind.REGEX, "a+") for _ in range(2)]
    with pytest.raises(ValueError, match="2 x 1536 words"):
        smollm2_backend.fill_bitmask_batch(grammars, allocate_token_bitmask(3, VOCAB))
    with pytest.raises(ValueError, match="int32"):
        smollm2_backend.fill_bitmask_batch(grammars, torch.zeros((2, 1536), dtype=torch.int64))
    wide = allocate_token_bitmask(2, VOCAB + 64)  # another width: the per-row fill still works, uncached
    grammars[0].fill_bitmask(wide, 1)
    assert allowed_ids(wide[1]) == set(Guide(grammars[0].compiled.index).get_tokens())


def test_rows_of_one_state_share_one_table_row(smollm2_backend, smollm2_tokenizer):
    grammar = smollm2_backend.compile(GuidedKind.JSON, json.dumps(BENCH_SCHEMAS[0]))
    prefix = smollm2_tokenizer.encode('{"name": "Al', add_special_tokens=False)
    forks = [grammar.fork() for _ in range(5)]
    for fork in forks:
        assert fork.accept_tokens(prefix)
    slots = {fork.mask_slot() for fork in forks}
    assert len(slots) == 1
    count = smollm2_backend.masks.count
    bitmask = torch.empty((5, 1536), dtype=torch.int32)
    smollm2_backend.fill_bitmask_batch(forks, bitmask)
    assert smollm2_backend.masks.count == count  # nothing new written
    assert all(torch.equal(bitmask[0], bitmask[i]) for i in range(5))
