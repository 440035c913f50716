"""runtime-plugin-{{ cookiecutter.__hyphenated }}: {{ cookiecutter.description }}

Hook implementations. The runtime finds this module through the entry point in
pyproject.toml and calls each ``register_*`` hook once per process with a
``register`` callback. Keep imports here light: import heavy code inside the
factories, which run only when the component is chosen.
"""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("runtime")

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
# the component; see runtime/hookspecs.py for each hook's full contract.
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
#         def total_memory_bytes(self):
#             return 8 << 30
#
#         def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
#             return cache_config.kv_cache_memory_bytes or 1 << 30
#
#     register(MyPlatform())

# A weight quantization method, chosen with --quantization or detected from the
# checkpoint (HF quantization_config, GGUF file type).
#
# @hookimpl
# def register_quant_methods(register):
#     def detect(hf_config, model_path):
#         config = getattr(hf_config, "quantization_config", None) or {}
#         return config.get("quant_method") == "my_quant"
#
#     def factory():
#         from runtime_{{ cookiecutter.__underscored }}.quant import MyQuantMethod
#
#         return MyQuantMethod()
#
#     register("my_quant", factory, detect=detect)

# A speculative-decoding proposer, chosen with --speculative-method and
# --num-speculative-tokens; propose(requests) returns draft token ids per request.
#
# @hookimpl
# def register_proposers(register):
#     def factory(vllm_config):
#         from runtime_{{ cookiecutter.__underscored }}.proposer import MyProposer
#
#         return MyProposer(vllm_config)
#
#     register("my_proposer", factory)

# A KV-cache offload tier, chosen with --kv-offload and sized with --kv-offload-size;
# the tier has store(block_hash, tensors), load(block_hash) and contains(block_hash).
#
# @hookimpl
# def register_kv_tiers(register):
#     def factory(cache_config, size_bytes):
#         from runtime_{{ cookiecutter.__underscored }}.kv_tier import MyTier
#
#         return MyTier(size_bytes)
#
#     register("my_tier", factory)

# An executor that drives workers, chosen with --executor; it has initialize(),
# execute_model(scheduler_output) and shutdown().
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

# A structured-output backend, chosen with --guided-backend; it compiles JSON
# schemas, regexes and grammars into token masks.
#
# @hookimpl
# def register_guided_backends(register):
#     def factory(tokenizer):
#         from runtime_{{ cookiecutter.__underscored }}.guided import MyGuidedBackend
#
#         return MyGuidedBackend(tokenizer)
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
