"""runtime-plugin-outlines: the ``outlines`` guided decoding backend (JSON schema, regex,
choice and JSON object constraints), built on outlines-core."""

from __future__ import annotations

from runtime import hookimpl


def make_backend(tokenizer, vocab_size: int):
    """``factory(tokenizer, vocab_size)`` of the ``outlines`` guided backend."""
    from runtime_outlines.backend import OutlinesBackend

    return OutlinesBackend(tokenizer, vocab_size)


@hookimpl
def register_guided_backends(register):
    register("outlines", make_backend)
