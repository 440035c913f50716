"""Extension points of the runtime, as pluggy hook specifications.

Every ``register_*`` hook receives a ``register`` callback. A plugin calls it once
for each component it provides; the component's name is what users pass on the
command line (``--platform cpu``). Built-in components register through these same
hooks from :mod:`runtime.builtins`.

Heavy imports belong inside the registered factory, not at module import time, so
that listing plugins stays fast.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("runtime")


@hookspec
def register_platforms(register):
    """Register hardware platforms.

    :param register: ``register(platform)`` where ``platform`` is an instance of
        :class:`runtime.platforms.Platform` (``name``, ``priority``,
        ``is_available()``, ``device_type``, memory queries, ``dist_backend`` and
        ``default_attention_backend``).

    Called once per process when the plugin manager loads. Not firstresult: every
    plugin's platforms are collected. Two platforms with one name are an error.
    """


@hookspec
def register_attention_backends(register):
    """Register attention backends that run paged attention over the KV cache.

    :param register: ``register(name, factory, *, platforms, dtypes=None,
        head_sizes=None)``; ``factory()`` returns an object implementing
        :class:`runtime.attention.backend.AttentionBackend`. ``platforms`` names the
        platforms the backend runs on; ``dtypes`` and ``head_sizes`` restrict it
        (``None`` means any).

    Selected with ``--attention-backend`` (default: the platform's
    ``default_attention_backend``). Not firstresult.
    """


@hookspec
def register_quant_methods(register):
    """Register weight quantization methods.

    :param register: ``register(name, factory, *, detect=None)``; ``factory()``
        returns a :class:`runtime.quantization.QuantMethod`. ``detect(hf_config,
        model_path)`` returns True when a checkpoint uses this method (from the
        Hugging Face ``quantization_config`` or a GGUF file type).

    Selected with ``--quantization`` (default: the first method whose ``detect``
    says yes). Not firstresult.
    """


@hookspec
def register_proposers(register):
    """Register speculative-decoding proposers (ngram, draft model, EAGLE, Medusa).

    :param register: ``register(name, factory)``; ``factory(vllm_config)`` returns a
        proposer with ``propose(requests) -> list[list[int]]`` draft tokens.

    Selected with ``--speculative-method`` together with
    ``--num-speculative-tokens``. Not firstresult.
    """


@hookspec
def register_kv_tiers(register):
    """Register KV-cache offload tiers (CPU memory, disk) and their eviction policy.

    :param register: ``register(name, factory)``; ``factory(cache_config,
        size_bytes)`` returns a tier with ``store(block_hash, tensors)``,
        ``load(block_hash)`` and ``contains(block_hash)``.

    Selected with ``--kv-offload`` and sized with ``--kv-offload-size``. Not
    firstresult.
    """


@hookspec
def register_executors(register):
    """Register executors that drive one or more workers.

    :param register: ``register(name, factory)``; ``factory(config)`` returns an
        object implementing :class:`runtime.executor.Executor`
        (``initialize()``, ``execute_model(scheduler_output)``, ``shutdown()``, and optionally
        ``execute_model_async(scheduler_output)`` returning an object with ``result()``, which
        async scheduling needs).

    Selected with ``--executor`` (default: ``uniproc`` when
    ``--tensor-parallel-size`` is 1). Not firstresult.
    """


@hookspec
def register_models(register):
    """Register model implementations by Hugging Face architecture name.

    :param register: ``register(architecture, factory)``; ``architecture`` is a
        name from ``config.json``'s ``architectures`` (``"LlamaForCausalLM"``) and
        ``factory()`` returns the model class (imported lazily).

    The model class is chosen by the checkpoint's config. Not firstresult; a later
    registration of the same architecture is an error.
    """


@hookspec
def register_guided_backends(register):
    """Register structured-output (guided decoding) backends.

    :param register: ``register(name, factory)``; ``factory(tokenizer)`` returns a
        backend that compiles JSON schemas, regexes and grammars into token masks.

    Selected with ``--guided-backend``. Not firstresult.
    """


@hookspec
def register_commands(cli):
    """Add subcommands to the ``runtime`` command line.

    :param cli: the ``argparse`` subparsers object of the ``runtime`` command; call
        ``cli.add_parser(name, help=...)`` and set ``func`` with
        ``set_defaults(func=handler)``; ``handler(args)`` returns an exit code.

    Not firstresult.
    """


@hookspec
def register_routes(app):
    """Add HTTP routes to the OpenAI-compatible server.

    :param app: the ``fastapi.FastAPI`` application, before it starts serving.

    Not firstresult.
    """
