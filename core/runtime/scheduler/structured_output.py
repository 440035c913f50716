"""Grammars of constrained requests: compiled off the step loop, one bitmask per step.

A request with ``structured_outputs`` waits for its grammar outside the scheduler's waiting
queue. :class:`StructuredOutputManager` compiles each distinct (kind, spec) once in a thread
pool (the guided backend itself is built there too, on first use: it reads the whole
vocabulary) and gives each request its own :meth:`Grammar.fork`. A compile that fails, or
that is still running when the request's time limit passes, fails that request with a
ValueError naming the problem; the engine goes on with the others.

A backend with an isolated compiler (:class:`runtime.structured_output.IsolatedCompileBackend`,
e.g. outlines) compiles in child processes instead (:mod:`runtime.scheduler.grammar_sandbox`):
each compile may use ``structured_output_compile_memory_bytes`` of memory and is killed at the
time limit, so no spec can take the engine's memory or a compile thread for good. The cache of
compiled grammars is bounded by their size as well as their number.

A compile that no request waits for any more (they were aborted, or their time limit passed) is
dropped: taken off the queue, or, compiling in a child process, killed. So clients that send slow
specs and hang up hold no compile worker that another client's grammar needs. A compile's own
time limit starts when it starts; a request that waited its whole time limit in the queue fails
with a message saying so.

Each step, :meth:`StructuredOutputManager.grammar_bitmask` gives the scheduled constrained
requests their bitmask rows, to be filled with their grammars' allowed next tokens when the
model runner asks for them: after it has queued the step's forward pass, so that the host
fills them while the device computes. The grammars advance in ``update_from_output``, on the
tokens that come back; with async scheduling the engine collects the step in flight just
before the fill, so that the rows follow its tokens. The worker applies the bitmask to the
logits on the device before sampling.

A request whose output starts with a reasoning block (``structured_outputs.reasoning``) holds a
:class:`runtime.scheduler.reasoning_gate.ReasoningGate` beside its grammar: the grammar starts after
the block, and the block's tokens get no row (or, with a token in flight, a row allowing every token).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.scheduler.reasoning_gate import OPENING, ReasoningGate

if TYPE_CHECKING:
    import torch

    from runtime.scheduler.grammar_sandbox import GrammarSandbox
    from runtime.sampling_params import ReasoningTags
    from runtime.scheduler.request import Request
    from runtime.structured_output import DeferredBitmask, Grammar, GuidedBackend

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# and at most this much memory of isolated compiles' grammars, estimated from their pickled size: an outlines
# index takes ~1.5 times its pickle once loaded (SmolLM2, a 100-field schema: 55.6 MB for 36.2 MB)
CACHE_BYTES = 1 << 30
LOADED_PER_PICKLED = 1.5
NUM_COMPILE_THREADS = 2
DEFAULT_COMPILE_MEMORY_BYTES = 4 << 30


class RequestGrammar:
    """One request's grammar: pending while it compiles, then its own fork; and its reasoning gate, if any."""

    __slots__ = ("kind", "spec", "future", "deadline", "grammar", "ended", "gate")

    def __init__(self, kind: str, spec: str, future: concurrent.futures.Future, deadline: float, gate=None):
        self.kind = kind
        self.spec = spec
        self.future = future  # -> the compiled grammar shared by every request with this spec
        self.deadline = deadline  # time.monotonic() after which a pending compile fails the request
        self.grammar: Grammar | None = None
        self.ended = False  # the grammar completed on a content token and so ended the request
        self.gate: ReasoningGate | None = gate  # the output's reasoning comes first, unconstrained

    def takes(self, output_ids: list[int]) -> bool:
        """The output's last token was appended: whether the grammar takes it (not a reasoning token)."""
        return self.gate is None or self.gate.advance(output_ids)

    @property
    def constrains(self) -> bool:
        """Whether the next token is sampled under the grammar (not in the reasoning)."""
        return self.gate is None or not self.gate.is_reasoning

    def may_constrain(self, request: Request) -> bool:
        """Whether ``request``'s token this step may be constrained: past the reasoning, or with a token of
        an earlier step in flight that may end it (its row is filled once that token is back)."""
        return self.constrains or request.num_output_placeholders > 1


def _reusable(future: concurrent.futures.Future) -> bool:
    """A cached compile to join: running, compiled, or failed on a bad spec (it would fail the same
    way again); not one cancelled or failed in a way that may not repeat (a time limit, a backend error)."""
    if future.cancelled():
        return False
    return not future.done() or future.exception() is None or isinstance(future.exception(), ValueError)


def _artifact_bytes(future: concurrent.futures.Future) -> int:
    """The memory a compiled grammar is estimated to hold (0 while compiling, failed, or compiled in process)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return int(future.result()[1] * LOADED_PER_PICKLED)


class StructuredOutputManager:
    """Compiles grammars in a thread pool, caches them by (kind, spec), fills bitmasks.

    ``backend_factory()`` builds the :class:`GuidedBackend` (called once, in the pool);
    ``vocab_size`` is the width of the model's logits; ``compile_memory`` the bytes an isolated
    compile may use.
    """

    def __init__(self, backend_factory: Callable[[], GuidedBackend], vocab_size: int, compile_timeout: float,
                 compile_memory: int = DEFAULT_COMPILE_MEMORY_BYTES):
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.compile_memory = compile_memory
        self._backend_factory = backend_factory
        self._backend: GuidedBackend | None = None
        self._sandbox: GrammarSandbox | None = None  # set with the backend when it compiles in isolation
        self._backend_lock = threading.Lock()
        self._pool = self._new_pool()
        # (kind, spec) -> future of (grammar, artifact bytes: 0 unless compiled in isolation)
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        # Compiles of the current pool still running past a request's time limit. A thread cannot
        # be stopped, so once they hold every thread of the pool, new compiles go to a new pool.
        self._overdue: set[concurrent.futures.Future] = set()
        # Pending compiles -> the requests waiting for each, and the handle that stops an isolated one.
        self._waiters: dict[concurrent.futures.Future, int] = {}
        self._handles: dict[concurrent.futures.Future, object] = {}

    @staticmethod
    def _new_pool() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="grammar-compile")

    # ---------------------------------------------------------------- compile
    def submit(self, kind: str, spec: str, reasoning: ReasoningTags | None = None) -> RequestGrammar:
        """Start (or join) the compile of (kind, spec) for one request (``reasoning``: the tags of the block
        its output starts with, which the grammar leaves free)."""
        key = (kind, spec)
        future = self._cache.get(key)
        deadline = time.monotonic() + self.compile_timeout
        if future is None or not _reusable(future):
            from runtime.scheduler.grammar_sandbox import CompileHandle

            handle = CompileHandle()
            future = self._pool.submit(self._compile, kind, spec, handle)
            self._handles[future] = handle
            future.add_done_callback(self._compile_ended)
            self._cache[key] = future
            self._evict()
        else:
            self._cache.move_to_end(key)
        if not future.done():
            self._waiters[future] = self._waiters.get(future, 0) + 1
        return RequestGrammar(kind, spec, future, deadline, None if reasoning is None else ReasoningGate(reasoning))

    def _compile_ended(self, future: concurrent.futures.Future) -> None:
        # (in the compile thread, or the scheduler's on cancel: dict operations are atomic)
        self._handles.pop(future, None)

    def release(self, request_grammar: RequestGrammar) -> None:
        """The request left before its grammar was ready (aborted): it no longer waits for the compile."""
        if request_grammar.grammar is None:
            self._unwait(request_grammar)

    def _unwait(self, request_grammar: RequestGrammar) -> None:
        """The request no longer waits for its compile; with none left waiting, a pending compile is dropped
        (see the module docstring)."""
        future = request_grammar.future
        left = self._waiters.get(future, 0) - 1
        if left > 0:
            self._waiters[future] = left
            return
        self._waiters.pop(future, None)
        if future.done():
            return
        if not future.cancel():  # running: a compile in a child process is killed (one in a thread cannot be
            handle = self._handles.get(future)  # stopped, and stays cached for a request of the same spec to join)
            if handle is None or (self._backend is not None and self._sandbox is None):
                return
            handle.cancel()
        key = (request_grammar.kind, request_grammar.spec)
        if self._cache.get(key) is future:
            del self._cache[key]  # the next request for it compiles it afresh

    def _evict(self) -> None:
        """Drop the least recently used grammars past CACHE_SIZE of them or CACHE_BYTES of artifacts
        (requests holding a fork keep theirs)."""
        total = sum(map(_artifact_bytes, self._cache.values()))
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or total > CACHE_BYTES):
            _, future = self._cache.popitem(last=False)
            total -= _artifact_bytes(future)

    def _compile(self, kind: str, spec: str, handle) -> tuple[Grammar, int]:
        from runtime.structured_output import GuidedKind

        start = time.perf_counter()
        deadline = time.monotonic() + self.compile_timeout  # from the compile's start, not its request's arrival
        backend = self._get_backend()
        if self._sandbox is None:
            grammar, size = backend.compile(GuidedKind(kind), spec), 0
        else:
            from runtime.scheduler.grammar_sandbox import CompileTimeout

            try:
                artifact, size = self._sandbox.compile(kind, spec, deadline, handle)
            except CompileTimeout:
                raise TimeoutError(self._timeout_message(kind)) from None
            grammar = backend.load_compiled(GuidedKind(kind), spec, artifact)
        logger.info("compiled a %s grammar in %.2f s", kind, time.perf_counter() - start)
        return grammar, size

    def _timeout_message(self, kind: str) -> str:
        return (f"compiling the {kind} grammar took longer than {self.compile_timeout:g} s "
                "(structured_output_compile_timeout); simplify the schema or raise the limit")

    def _get_backend(self) -> GuidedBackend:
        with self._backend_lock:
            if self._backend is None:
                backend = self._backend_factory()
                if callable(getattr(backend, "isolated_compiler", None)):
                    from runtime.scheduler.grammar_sandbox import GrammarSandbox

                    self._sandbox = GrammarSandbox(backend.isolated_compiler(), self.compile_memory)
                self._backend = backend
            return self._backend

    def poll(self, request_grammar: RequestGrammar) -> bool:
        """True once the request's grammar is ready (forked onto it); False while it compiles.

        Raises ValueError when the compile failed or the request's time limit passed.
        """
        if request_grammar.grammar is not None:
            return True
        future = request_grammar.future
        if future.cancelled():  # queued behind runaway compiles in a pool since replaced: queue it again
            self._unwait(request_grammar)
            request_grammar.future = self.submit(request_grammar.kind, request_grammar.spec).future
            return False
        if not future.done():
            if time.monotonic() < request_grammar.deadline:
                return False
            queued = not future.running()
            if self._sandbox is None:  # an isolated compile is killed at its deadline: it frees its thread
                self._note_overdue(future)
            self._unwait(request_grammar)
            if queued:
                raise ValueError(
                    f"the {request_grammar.kind} grammar waited {self.compile_timeout:g} s "
                    "(structured_output_compile_timeout) for a compile worker, all busy with other requests' grammars; "
                    "retry later")
            raise ValueError(self._timeout_message(request_grammar.kind))
        self._unwait(request_grammar)
        error = future.exception()
        if error is not None:
            self._forget(request_grammar, future)
            if isinstance(error, TimeoutError):
                raise ValueError(str(error)) from None
            if isinstance(error, ValueError):
                raise ValueError(f"invalid {request_grammar.kind} for structured output: {error}") from None
            raise ValueError(
                f"the guided decoding backend failed on this {request_grammar.kind}: {type(error).__name__}: {error}"
            ) from None
        request_grammar.grammar = future.result()[0].fork()
        return True

    def _note_overdue(self, future: concurrent.futures.Future) -> None:
        """A compile outlived a request's time limit. It stays cached (a request for the same spec
        waits on it rather than starting another), but once such compiles occupy every thread,
        the pool is replaced so that other specs still compile; compiles queued in the old pool are
        cancelled and queued again in the new one."""
        self._overdue = {f for f in self._overdue if not f.done()}
        if not future.running():
            return  # still queued: it holds no thread
        self._overdue.add(future)
        if len(self._overdue) >= NUM_COMPILE_THREADS:
            logger.warning(
                "%d grammar compiles are still running past their time limit; compiling in new threads", len(self._overdue)
            )
            old, self._pool, self._overdue = self._pool, self._new_pool(), set()
            old.shutdown(wait=False, cancel_futures=True)

    def _forget(self, request_grammar: RequestGrammar, future: concurrent.futures.Future) -> None:
        """Drop a failed compile from the cache unless it is a bad spec (those fail again the same way)."""
        if not isinstance(future.exception(), ValueError):
            key = (request_grammar.kind, request_grammar.spec)
            if self._cache.get(key) is future:
                del self._cache[key]

    @staticmethod
    def wait(pending: list[RequestGrammar], timeout: float) -> None:
        """Block up to ``timeout`` s until one of ``pending`` finishes compiling (an idle engine
        waits here instead of spinning against the compile threads)."""
        futures = [g.future for g in pending if not g.future.done()]
        if futures and len(futures) == len(pending):
            deadline = min(g.deadline for g in pending) - time.monotonic()
            concurrent.futures.wait(futures, timeout=max(0.0, min(timeout, deadline)), return_when="FIRST_COMPLETED")

    # ---------------------------------------------------------------- bitmask
    def attach_bitmask(self, output, requests: dict[str, Request]) -> None:
        """Put on the step ``output`` (a :class:`runtime.messages.SchedulerOutput`) the bitmask of every
        scheduled constrained request that samples this step (one with a token in flight decodes:
        its computed tokens pass the known ones, so it has a row)."""
        constrained = [
            request
            for req_id in output.num_scheduled_tokens
            if (request := requests[req_id]).grammar is not None
            and request.num_computed_tokens >= request.num_tokens  # its chunk reaches the end: it samples
            and request.grammar.may_constrain(request)
        ]
        if constrained:
            output.structured_output_request_ids, output.grammar_bitmask = self.grammar_bitmask(constrained)

    def grammar_bitmask(self, requests: list[Request]) -> tuple[dict[str, int], DeferredBitmask]:
        """Rows of allowed next tokens for ``requests`` (each with a ready grammar):
        ``({request_id: row}, bitmask)``; the bitmask's ``tensor()`` is a new CPU int32 tensor
        (see :func:`runtime.structured_output.allocate_token_bitmask`) that the step owns,
        filled when first asked for (see :meth:`fill_rows`)."""
        from runtime.structured_output import DeferredBitmask

        rows = {request.request_id: row for row, request in enumerate(requests)}
        slots = (lambda: self.slot_rows(requests)) if hasattr(self._backend, "bitmask_slots") else None
        return rows, DeferredBitmask(lambda: self.fill_rows(requests), slots)

    def slot_rows(self, requests: list[Request]):
        """:meth:`fill_rows`'s bitmask as a :class:`runtime.structured_output.SlotBitmask` (the
        backend has ``bitmask_slots``); a request finished meanwhile, or still reasoning, gets slot -1
        (every token). None (a dense fill) where an output may still open its reasoning block."""
        import numpy as np

        from runtime.structured_output import bitmask_slots

        live = _constrained_rows(requests)
        if any(requests[row].grammar.gate is not None and requests[row].grammar.gate.phase == OPENING for row in live):
            return None  # a table row cannot add the start tag
        result = bitmask_slots(self._backend, [requests[row].grammar.grammar for row in live])
        if len(live) == len(requests):
            return result
        slots = np.full(len(requests), -1, dtype=np.int32)
        slots[live] = result.slots
        return result.with_slots(slots)

    def fill_rows(self, requests: list[Request]) -> torch.Tensor:
        """A new bitmask, row ``i`` for ``requests[i]``'s grammar as it is now.

        With async scheduling the step in flight is collected first (see
        :class:`runtime.structured_output.DeferredBitmask`), and it may have finished some of
        ``requests`` (grammar complete, stop token, max_tokens): their rows allow every token,
        since the token they sample is dropped; so do the rows of those still in their reasoning.
        """
        import torch

        from runtime.structured_output import allocate_token_bitmask

        live = _constrained_rows(requests)
        if len(live) == len(requests):
            bitmask = self.fill_bitmask([request.grammar.grammar for request in requests])
        else:
            bitmask = allocate_token_bitmask(len(requests), self.vocab_size)
            if live:
                bitmask[torch.tensor(live)] = self.fill_bitmask([requests[row].grammar.grammar for row in live])
        for row in live:
            if requests[row].grammar.gate is not None:  # the first token of an output that may open its reasoning
                requests[row].grammar.gate.add_start_tag(bitmask[row].numpy())
        return bitmask

    def fill_bitmask(self, grammars: list[Grammar]) -> torch.Tensor:
        """A new bitmask, row ``i`` filled by ``grammars[i]`` (the backend's batched fill where it has one)."""
        import torch

        from runtime.structured_output import allocate_token_bitmask, fill_bitmask_batch

        if hasattr(self._backend, "fill_bitmask_batch"):  # writes every row: no need to set them first
            bitmask = torch.empty((len(grammars), (self.vocab_size + 31) // 32), dtype=torch.int32)
        else:
            bitmask = allocate_token_bitmask(len(grammars), self.vocab_size)
        fill_bitmask_batch(self._backend, grammars, bitmask)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()


def _constrained_rows(requests: list[Request]) -> list[int]:
    """Rows of the requests that sample under their grammar now (not finished, not reasoning)."""
    return [row for row, request in enumerate(requests) if not request.is_finished() and request.grammar.constrains]
