"""Coalescing of the outputs queued for a stream whose reader is slower than the engine.

When several RequestOutputs of one request wait in its queue, the reader takes them as
one: with ``RequestOutputKind.DELTA`` the deltas of each completion are concatenated
(text, token ids, logprobs), otherwise the newest output already holds everything.
The text a client receives is the same; it arrives in fewer, larger chunks.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import RequestOutputKind


def take_queued(item, queue: asyncio.Queue, kind: RequestOutputKind) -> tuple[object, BaseException | None]:
    """``item`` (a RequestOutput or an error) merged with the outputs queued behind it: a reader that fell
    behind the engine gets them as one. An error met on the way is returned second, to raise after them."""
    while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
        newer = queue.get_nowait()
        if isinstance(newer, BaseException):
            return item, newer
        item = merge_outputs(item, newer, kind)
    return item, None


def merge_outputs(older: RequestOutput, newer: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """One output equivalent to ``older`` followed by ``newer`` (of the same request)."""
    if kind != RequestOutputKind.DELTA:
        return newer
    by_index = {c.index: c for c in older.outputs}
    for completion in newer.outputs:
        before = by_index.get(completion.index)
        by_index[completion.index] = completion if before is None else _merge_completion(before, completion)
    return replace(
        newer,
        outputs=[by_index[i] for i in sorted(by_index)],
        prompt_logprobs=older.prompt_logprobs if older.prompt_logprobs is not None else newer.prompt_logprobs,
    )


def _merge_completion(before: CompletionOutput, after: CompletionOutput) -> CompletionOutput:
    logprobs = before.logprobs
    if after.logprobs is not None:
        logprobs = (logprobs or []) + after.logprobs
    return replace(
        after, text=before.text + after.text, token_ids=before.token_ids + after.token_ids, logprobs=logprobs
    )
