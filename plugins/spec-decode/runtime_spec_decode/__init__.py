"""runtime-plugin-spec-decode: speculative-decoding proposers.

``ngram`` (prompt lookup): drafts the tokens that followed the most recent earlier
occurrence of the request's longest suffix n-gram. Select it with
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` (or
``--speculative-method ngram --num-speculative-tokens K``); its options,
``prompt_lookup_min`` and ``prompt_lookup_max`` (vLLM's names and defaults), are read from
``config.plugin_options["speculative_config"]``.
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_proposers(register):
    def ngram(config):
        from runtime_spec_decode.ngram import NgramProposer

        return NgramProposer.from_config(config)

    register("ngram", ngram)

    def draft_model(config):
        from runtime_spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer.from_config(config)

    def draft_positions(spec):
        from runtime_spec_decode.draft_model import draft_positions

        return draft_positions(spec)

    draft_model.max_positions = draft_positions  # read by the engine (runtime.spec_decode)
    register("draft_model", draft_model)

    def eagle_factory(method):
        def build(config):
            from runtime_spec_decode.eagle import EagleProposer

            return EagleProposer.from_config(config, method)

        return build

    register("eagle", eagle_factory("eagle"))
    register("eagle3", eagle_factory("eagle3"))

    def medusa(config):
        from runtime_spec_decode.medusa import MedusaProposer

        return MedusaProposer.from_config(config)

    register("medusa", medusa)
