"""runtime-plugin-{{ cookiecutter.__hyphenated }}: {{ cookiecutter.description }}

Hook implementations. The runtime finds this module through the entry point in
pyproject.toml and calls each ``register_*`` hook once per process with a
``register`` callback. Keep imports here light: import heavy code inside the
factories, which run only when the component is chosen.
"""

from __future__ import annotations

from runtime import hookimpl

BACKEND_NAME = "{{ cookiecutter.__underscored }}_sdpa"


@hookimpl
def register_attention_backends(register):
    """The attention backend, chosen with ``--attention-backend {{ cookiecutter.__underscored }}_sdpa``."""

    def factory():
        from runtime_{{ cookiecutter.__underscored }}.attention import {{ cookiecutter.__class_prefix }}AttentionBackend

        return {{ cookiecutter.__class_prefix }}AttentionBackend()

    # platforms: where it runs; dtypes / head_sizes (None: any) restrict it further.
    register(BACKEND_NAME, factory, platforms=["cpu"])


# ---------------------------------------------------------------------------------
# Examples of every other hook. Uncomment one, rename what it registers, and write
# the component; runtime/hookspecs.py names each hook's contract (a Protocol or base
# class in core). A component that lacks a required method is refused with an error.
# ---------------------------------------------------------------------------------

# A hardware platform, chosen with --platform (default: the available one with the
# highest priority).
#
# @hookimpl
# def register_platforms(register):
#     from runtime.platforms import Platform
#
#     class MyPlatform(Platform):
#         name = "my_device"
#         device_type = "cpu"
#         priority = 10
#         dist_backend = "gloo"
#         default_attention_backend = BACKEND_NAME
#
#         def is_available(self):  # must not initialize the device in a way that breaks fork
#             return True
#
#         def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
#             return cache_config.kv_cache_memory_bytes or 1 << 30
#
#     register(MyPlatform())

# A weight quantization method (runtime.quantization.QuantMethod), chosen with
# --quantization or detected from the checkpoint's HF quantization_config.
#
# @hookimpl
# def register_quant_methods(register):
#     def detect(quantization_config):
#         return (quantization_config or {}).get("quant_method") == "my_quant"
#
#     def factory():
#         from runtime_{{ cookiecutter.__underscored }}.quant import MyQuantMethod
#
#         return MyQuantMethod()
#
#     register("my_quant", factory, detect=detect)

# A speculative-decoding proposer (runtime.spec_decode.Proposer), chosen with
# --speculative-method and --num-speculative-tokens; propose(batch) returns the drafts.
#
# @hookimpl
# def register_proposers(register):
#     def factory(config):
#         from runtime_{{ cookiecutter.__underscored }}.proposer import MyProposer
#
#         return MyProposer(config)
#
#     register("my_proposer", factory)

# A KV connector (runtime.kv_transfer): factory(config, role) returns the scheduler
# half or the worker half, which move KV blocks between the device cache and elsewhere.
#
# @hookimpl
# def register_kv_connectors(register):
#     def factory(config, role):
#         from runtime_{{ cookiecutter.__underscored }} import connector
#
#         return connector.MyScheduler(config) if role == "scheduler" else connector.MyWorker(config)
#
#     register("my_connector", factory)

# A KV-cache offload tier (runtime.kv_transfer.KVTier), chosen with --kv-offload and
# sized with --kv-offload-size: store(block_hash, data), load(block_hash), contains(block_hash).
#
# @hookimpl
# def register_kv_tiers(register):
#     def factory(config, size_bytes):
#         from runtime_{{ cookiecutter.__underscored }}.kv_tier import MyTier
#
#         return MyTier(size_bytes)
#
#     register("my_tier", factory)

# An executor that drives workers (runtime.executor.base.Executor), chosen with
# --executor; factory(config) returns it: initialize(), execute_model(scheduler_output),
# shutdown().
#
# @hookimpl
# def register_executors(register):
#     def factory(config):
#         from runtime_{{ cookiecutter.__underscored }}.executor import MyExecutor
#
#         return MyExecutor(config)
#
#     register("my_executor", factory)

# A model implementation, chosen by config.json's "architectures"; the factory
# returns the class (imported only when a checkpoint needs it).
#
# @hookimpl
# def register_models(register):
#     def factory():
#         from runtime_{{ cookiecutter.__underscored }}.model import MyModelForCausalLM
#
#         return MyModelForCausalLM
#
#     register("MyModelForCausalLM", factory)

# A structured-output backend (runtime.structured_output.GuidedBackend), chosen with
# --guided-backend; compile(kind, spec) returns a Grammar that fills token bitmasks.
#
# @hookimpl
# def register_guided_backends(register):
#     def factory(tokenizer, vocab_size):
#         from runtime_{{ cookiecutter.__underscored }}.guided import MyGuidedBackend
#
#         return MyGuidedBackend(tokenizer, vocab_size)
#
#     register("my_guided", factory)

# A subcommand of the `runtime` command line; the handler returns the exit code.
#
# @hookimpl
# def register_commands(cli):
#     parser = cli.add_parser("{{ cookiecutter.__hyphenated }}-hello", help="say hello")
#     parser.add_argument("--name", default="world")
#     parser.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)

# HTTP routes on the OpenAI-compatible server (a fastapi.FastAPI app).
#
# @hookimpl
# def register_routes(app):
#     @app.get("/{{ cookiecutter.__hyphenated }}/health")
#     def health():
#         return {"plugin": "{{ cookiecutter.__hyphenated }}", "ok": True}
