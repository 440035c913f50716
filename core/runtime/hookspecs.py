"""Extension points of the runtime, as pluggy hook specifications.

Every ``register_*`` hook receives a typed ``register`` callback
(:mod:`runtime.registration`). A plugin calls it once for each component it provides;
the component's name is what users pass on the command line (``--platform cpu``).
Built-in components register through these same hooks from :mod:`runtime.builtins`.
Plugins mark their implementations with :data:`runtime.hookimpl`.

Heavy imports belong inside the registered factory, not at module import time, so
that listing plugins stays fast. A component given directly (a platform instance, a
class as the factory) is checked against its contract when registered; one built by a
factory is checked when first built. A missing method is an error naming the plugin.
None of these hooks is firstresult: every plugin's registrations are collected, and two
components of one kind with one name are an error naming both packages.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("runtime")
hookimpl = pluggy.HookimplMarker("runtime")


@hookspec
def register_platforms(register):
    """Register hardware platforms.

    :param register: ``register(platform)``; ``platform`` is an instance of
        :class:`runtime.platforms.Platform` (``name``, ``priority``, ``is_available()``,
        ``device()``, ``kv_cache_memory_bytes()``, ``dist_backend``, ``default_attention_backend``).

    Selected with ``--platform`` (default: the available platform of highest priority).
    """


@hookspec
def register_attention_backends(register):
    """Register attention backends that run paged attention over the KV cache.

    :param register: ``register(name, factory, *, platforms=None, dtypes=None,
        head_sizes=None)``; ``factory()`` returns a
        :class:`runtime.attention.backend.AttentionBackend`. ``platforms`` names the
        platforms it runs on (None: every platform); ``dtypes`` and ``head_sizes``
        restrict it (None: any).

    Selected with ``--attention-backend`` (default: the platform's ``default_attention_backend``).
    """


@hookspec
def register_quant_methods(register):
    """Register weight quantization methods.

    :param register: ``register(name, factory, *, detect=None)``; ``factory()`` returns a
        :class:`runtime.quantization.QuantMethod`, whose ``get_config`` gives a
        :class:`runtime.quantization.QuantConfig` that hands each linear layer a
        :class:`runtime.quantization.LinearMethod`. ``detect(quantization_config)`` returns
        True when a checkpoint's Hugging Face ``quantization_config`` uses this method.

    Selected with ``--quantization`` (default: the method a checkpoint's config names).
    """


@hookspec
def register_proposers(register):
    """Register speculative-decoding proposers (ngram, draft model, EAGLE, Medusa).

    :param register: ``register(name, factory)``; ``factory(config)`` gets the
        :class:`runtime.config.EngineConfig` and returns a
        :class:`runtime.spec_decode.Proposer`, which turns a
        :class:`runtime.spec_decode.ProposalBatch` into
        :class:`runtime.spec_decode.DraftProposals`.

    Selected with ``--speculative-config '{"method": NAME, "num_speculative_tokens": K, ...}'``
    (or its aliases ``--speculative-method`` / ``--num-speculative-tokens``); the merged dict
    is ``config.plugin_options["speculative_config"]``. The engine runs the proposer in
    EngineCore after every step; proposers that set ``uses_kv_cache`` or
    ``needs_hidden_states`` are refused at start-up for now.
    """


@hookspec
def register_kv_connectors(register):
    """Register KV connectors: KV blocks moved between the device cache and elsewhere
    (offload tiers, another engine for prefill/decode disaggregation).

    :param register: ``register(name, factory)``; ``factory(config, role)`` gets the
        :class:`runtime.config.EngineConfig` and a :class:`runtime.kv_transfer.KVConnectorRole`
        and returns the scheduler half (:class:`runtime.kv_transfer.KVConnectorScheduler`)
        or the worker half (:class:`runtime.kv_transfer.KVConnectorWorker`).
    """


@hookspec
def register_kv_tiers(register):
    """Register KV offload tiers (CPU memory, disk), the storage behind an offloading connector.

    :param register: ``register(name, factory)``; ``factory(config, size_bytes)`` gets the
        :class:`runtime.config.EngineConfig` and the tier's capacity and returns a
        :class:`runtime.kv_transfer.KVTier`.

    Selected with ``--kv-offload`` and sized with ``--kv-offload-size``.
    """


@hookspec
def register_executors(register):
    """Register executors that drive one or more workers.

    :param register: ``register(name, factory)``; ``factory(config)`` gets the
        :class:`runtime.config.EngineConfig` and returns a
        :class:`runtime.executor.base.Executor` (a class taking the config is a factory).

    Selected with ``--executor`` (default: ``uniproc``, the built-in single worker).
    """


@hookspec
def register_models(register):
    """Register model implementations by Hugging Face architecture name.

    :param register: ``register(architecture, factory)``; ``architecture`` is a name from
        ``config.json``'s ``architectures`` (``"LlamaForCausalLM"``) and ``factory()``
        returns the model class (imported lazily), a :class:`runtime.models.interface.CausalLM`.

    The model class is chosen by the checkpoint's config.
    """


@hookspec
def register_guided_backends(register):
    """Register structured-output (guided decoding) backends.

    :param register: ``register(name, factory)``; ``factory(tokenizer, vocab_size)`` returns
        a :class:`runtime.structured_output.GuidedBackend`, which compiles a
        :class:`runtime.structured_output.GuidedKind` and spec into a
        :class:`runtime.structured_output.Grammar`. A backend that also implements
        :class:`runtime.structured_output.IsolatedCompileBackend` has its compiles run in a child
        process under ``--structured-output-compile-memory-bytes``, killed at the time limit.

    Selected with ``--guided-decoding-backend`` (alias ``--guided-backend``); ``outlines`` is the
    default when installed.
    """


@hookspec
def register_commands(cli):
    """Add subcommands to the ``runtime`` command line.

    :param cli: the :class:`argparse._SubParsersAction` of the ``runtime`` command; call
        ``cli.add_parser(name, help=...)`` and ``set_defaults(func=handler)``;
        ``handler(args)`` returns an exit code.
    """


@hookspec
def register_routes(app):
    """Add HTTP routes to the OpenAI-compatible server.

    :param app: the :class:`fastapi.FastAPI` application, before it starts serving.
    """
