"""Compiled decode steps on the CPU: the model's forward through ``torch.compile`` (inductor's C++ backend).

Besides its matmuls, an eager batch-1 decode step spends its time in thousands of small
aten calls for norms, rotary embedding, activations and residual adds (about a fifth of the
default model's step on one core). Inductor fuses those, and the attention the backend
traces (``cpu_paged.traced_decode``), into a few C++ loops per layer and calls the matmuls
directly. The batch size is symbolic (unbacked, so batch 1 is not specialized): one
graph serves every decode batch. ``runtime.worker.graphs`` warms it at start-up and runs
it for decode-only steps; after the first call the graph is called without dynamo's frame
(:func:`_direct_call`).

On by default: the CPU platform compiles decode steps unless ``RUNTIME_CPU_COMPILE=0`` or
``--enforce-eager``. Compiling costs about a minute at an engine's first start on a 2-core
machine (the log says when it starts and how long it took) and ~10 s once inductor's cache
holds the generated code; ``benchmarks/RESULTS.md`` has the figures. The test suite, which
starts hundreds of engines, sets ``RUNTIME_CPU_COMPILE=0`` (tests/conftest.py) and compiles
only in the tests that check the compiled path.
Inductor's FX graph cache (on by default, under ``TORCHINDUCTOR_CACHE_DIR``, else
``/tmp/torchinductor_<user>``) keeps the generated C++ across processes, so a later start
with the same model and settings skips the C++ compilation (dynamo still traces).
"""

from __future__ import annotations

import itertools
import logging
import os
import types

import torch

from runtime.distributed import tp_size

logger = logging.getLogger(__name__)

COMPILE_ENV = "RUNTIME_CPU_COMPILE"
# No size/stride assertions on the outputs of the kernels it calls (the matmuls): hundreds a
# step, ~0.5 ms of a batch-1 step, checking shapes that are fixed. The graph's wrapper in C++
# rather than Python (its hundreds of kernel calls and buffer views): batch-1 TPOT of the
# default model ~10.2 -> ~9.5 ms, for ~1 min more of C++ compilation at the first start
# (inductor's cache keeps it).
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "cpp_wrapper": True}
_counter = itertools.count()


def compile_enabled() -> bool:
    value = (os.environ.get(COMPILE_ENV) or "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{COMPILE_ENV} must be 1 (compile decode steps) or 0 (eager), got {value!r}")
    return value in ("1", "true", "yes")


def compile_model(model: torch.nn.Module):
    """The model's forward compiled with inductor (one graph, no breaks), or None when off."""
    if not compile_enabled():
        logger.info("decode steps run eagerly (%s=0)", COMPILE_ENV)
        return None
    if tp_size() > 1:
        logger.info("decode steps run eagerly: tensor-parallel all-reduces are not compiled")
        return None

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)

    graphs: list[tuple] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled_graph = compile_fx(gm, example_inputs, config_patches=INDUCTOR_OPTIONS)
        graphs.append((compiled_graph, [node.meta.get("grapharg") for node in gm.graph.find_nodes(op="placeholder")]))
        return compiled_graph

    compiled = torch.compile(_own_code(forward), backend=backend, fullgraph=True)
    return CompiledForward(compiled, graphs, model, forward.__globals__)


class CompiledForward:
    """The compiled forward: dynamo compiles it at the first call, later calls go to its graph."""

    def __init__(self, compiled, graphs: list[tuple], model: torch.nn.Module, forward_globals: dict):
        self.compiled, self.graphs, self.model, self.forward_globals = compiled, graphs, model, forward_globals
        self.call = None
        self.calls_graph_directly = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.call is not None:
            return self.call(input_ids, positions)
        # One graph for every batch size, 1 included: an unbacked size is never specialized.
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        out = self.compiled(input_ids, positions)
        self.call = _direct_call(self.graphs, self.model, self.forward_globals)
        self.calls_graph_directly = self.call is not None
        if self.call is None:
            self.call = _unguarded(self.compiled)
        return out


def _unguarded(compiled):
    def call(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The one graph's guards (every parameter's dtype, shape and strides: ~1 ms a step on
        # one core) cannot fail in an engine: the weights, the input dtypes and the grad mode
        # (inference) stay as compiled.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(input_ids, positions)

    return call


def _direct_call(graphs: list[tuple], model: torch.nn.Module, forward_globals: dict):
    """The compiled graph called with its inputs gathered here, not by dynamo; None if it cannot be.

    Dynamo's frame around the graph costs ~0.5 ms a batch-1 step even without guards: its
    bytecode looks up every one of the graph's inputs (each parameter through the modules'
    attributes, ~460 for the default model with int4 weights). The parameters stay the same
    tensors for the engine's life, so they are looked up once here; each step evaluates only
    the inputs that change (the token ids, positions, attention inputs and KV caches of the
    forward context), from the sources dynamo recorded. The graph has no side effects to
    replay: the forward only computes and writes the KV caches, which the graph itself does.
    """
    if len(graphs) != 1 or not all(graphs[0][1]):
        return None
    compiled_graph, graph_args = graphs[0]
    scope = {"G": forward_globals, "device": torch.device}
    args: list = []
    per_step: list[tuple[int, object]] = []
    try:
        for i, graph_arg in enumerate(graph_args):
            name = graph_arg.source.name
            if name.startswith("L['model']"):
                args.append(eval(name, {**scope, "L": {"model": model}}))
            else:
                args.append(None)
                per_step.append((i, compile(name, "<graph input>", "eval")))
    except Exception as exc:  # a source this cannot evaluate: dynamo calls the graph
        logger.debug("compiled decode steps called through dynamo: %s", exc)
        return None

    def call(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        step_scope = {**scope, "L": {"input_ids": input_ids, "positions": positions}}
        for i, code in per_step:
            args[i] = eval(code, step_scope)
        try:
            out = compiled_graph(*args)
        finally:
            for i, _ in per_step:
                args[i] = None  # no step's tensors kept alive
        return out[0]

    return call


def _own_code(fn):
    """``fn`` with a code object of its own.

    Dynamo keeps compiled code per code object, at most ``recompile_limit`` (8) versions,
    and with ``fullgraph`` fails past that. Compiling ``model`` directly would put every
    engine of a process on the model class's ``forward`` (llama, qwen2 and qwen3 share
    one), each dtype, architecture and quantization a new version that is never freed.
    A code object per engine holds only that engine's version and goes with it; a later engine of the same model loads the
    generated code from inductor's cache instead of compiling it again.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_counter)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
