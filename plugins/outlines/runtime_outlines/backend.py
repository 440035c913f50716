"""The ``outlines`` guided backend: specs -> regular expressions -> outlines-core indexes
(:mod:`runtime_outlines.compiler`, which the engine runs in its grammar sandbox), each request
walking its own :class:`OutlinesGrammar` over the shared index, every grammar's bitmask rows
kept in one table (:class:`MaskTable`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from runtime.structured_output import GuidedKind, SlotBitmask
from runtime_outlines.compiler import DEFAULT_WHITESPACE, CompiledIndex, SpecCompiler
from runtime_outlines.grammar import CompiledSpec, OutlinesGrammar
from runtime_outlines.masks import MaskTable
from runtime_outlines.vocabulary import get_vocabulary

logger = logging.getLogger(__name__)


class OutlinesBackend:
    """Compiles json / regex / choice / json_object specs for one tokenizer
    (implements ``runtime.structured_output.IsolatedCompileBackend``)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, whitespace_pattern: str = DEFAULT_WHITESPACE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.vocab = get_vocabulary(tokenizer, vocab_size)
        width = vocab_size if vocab_size is not None else len(tokenizer)
        self.masks = MaskTable((width + 31) // 32, self.vocab.end_token_id)  # rows of every spec's states
        self.compiler = SpecCompiler(self.vocab.vocabulary, whitespace_pattern)

    # -------------------------------------------------------------- compile
    def to_regex(self, kind: GuidedKind | str, spec: str) -> str:
        """The regular expression the whole output must match for ``(kind, spec)``."""
        return self.compiler.to_regex(kind, spec)

    def isolated_compiler(self) -> SpecCompiler:
        """The expensive part of :meth:`compile`, for the engine's grammar sandbox
        (``runtime.structured_output.IsolatedCompileBackend``)."""
        return self.compiler

    def load_compiled(self, kind: GuidedKind | str, spec: str, artifact: CompiledIndex) -> OutlinesGrammar:
        kind_value = GuidedKind(kind)
        regex, seconds = artifact.regex, artifact.seconds
        logger.debug("outlines: compiled a %s spec (regex of %d chars) in %.2f s", kind_value.value, len(regex), seconds)
        return OutlinesGrammar(CompiledSpec(kind_value, regex, artifact.index, self.vocab, seconds, self.masks))

    def compile(self, kind: GuidedKind | str, spec: str) -> OutlinesGrammar:
        """Compile in this process (the engine uses the sandbox instead)."""
        return self.load_compiled(kind, spec, self.compiler(kind, spec))

    # -------------------------------------------------------------- a step's bitmask
    def fill_bitmask_batch(self, grammars: Sequence[OutlinesGrammar], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` for ``grammars[i]`` (this backend's), as ``fill_bitmask`` would
        write it: one slot lookup per row, then one gather of the mask table for every row."""
        masks = self.masks
        if (
            bitmask.dtype != torch.int32 or bitmask.shape != (len(grammars), masks.num_words)
            or bitmask.device.type != "cpu" or not bitmask.is_contiguous()
        ):
            raise ValueError(
                f"fill_bitmask_batch needs a contiguous CPU int32 bitmask of {len(grammars)} x {masks.num_words} words "
                f"(allocate_token_bitmask for this backend's vocab_size), got {bitmask.dtype} {tuple(bitmask.shape)} "
                f"on {bitmask.device}"
            )
        masks.gather([grammar.mask_slot() for grammar in grammars], bitmask)

    def bitmask_slots(self, grammars: Sequence[OutlinesGrammar]):
        """The step's bitmask as slots of the mask table (``runtime.structured_output.SlotBitmask``):
        one slot lookup per row, no row copied."""
        masks = self.masks
        slots = np.fromiter((grammar.mask_slot() for grammar in grammars), dtype=np.int32, count=len(grammars))
        result = SlotBitmask(masks.rows, masks.count, id(masks), masks.num_resets, slots)
        masks.end_fill()  # a reset starts a new table: ``result`` keeps the rows its slots name
        return result
