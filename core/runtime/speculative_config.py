"""``--speculative-config`` and its short aliases, resolved into one checked dict (see spec_decode.py for proposers)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MAX_SPECULATIVE_TOKENS = 16
# The keys speculative_config accepts (vLLM's names); proposers read their own options from it.
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def infer_method(model: str) -> str:
    """vLLM's rule for a ``model`` given without ``method``: the name says eagle3 / eagle /
    medusa, else the model is a draft model."""
    name = str(model).lower()
    for method in ("eagle3", "eagle", "medusa"):
        if method in name:
            return method
    return "draft_model"


def resolve_speculative_config(args) -> dict | None:
    """``speculative_config`` (a dict or JSON text) merged with its short aliases, checked.

    Returns None when speculation is off, else a new dict with at least ``method`` (a
    registered proposer; inferred from ``model`` when only that is given, as vLLM does) and
    ``num_speculative_tokens`` (1..16).
    """
    import json
    from collections.abc import Mapping

    raw = args.speculative_config
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object, got {args.speculative_config!r} ({exc})") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ValueError(f"speculative_config must be a JSON object (dict) or unset, got {args.speculative_config!r}")
    config = dict(raw or {})
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(SPECULATIVE_CONFIG_KEYS)}"
        )
    for key, alias in (("method", "speculative_method"), ("num_speculative_tokens", "num_speculative_tokens")):
        value = getattr(args, alias)
        if value is None:
            continue
        if key in config and config[key] != value:
            raise ValueError(
                f"--{alias.replace('_', '-')} {value!r} conflicts with speculative_config's {key} {config[key]!r}; give it once"
            )
        config[key] = value
    if not config:
        return None
    method = config.get("method")
    if method is None and config.get("model") is not None:
        method = config["method"] = infer_method(config["model"])
    if method is None:
        raise ValueError("speculative_config needs a 'method' (a proposer, e.g. \"ngram\") or a draft 'model'")
    from runtime.plugins import get_registry

    registry = get_registry("proposer")
    if not isinstance(method, str) or method not in registry:
        raise ValueError("speculative_config: " + registry.unknown_message(method))
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return config


def proposer_max_model_len(config: dict, max_model_len: int) -> int:
    """``max_model_len`` (the target's own: the user set none) lowered to the most positions the proposer
    holds, as vLLM lowers it for a shorter draft model. A proposer tells them through its factory's
    attribute ``max_positions`` (``max_positions(speculative_config) -> int | None``)."""
    from runtime.plugins import get_registry

    max_positions = getattr(get_registry("proposer").get(config["method"]), "max_positions", None)
    positions = max_positions(config) if max_positions is not None else None
    if positions is None or positions >= max_model_len:
        return max_model_len
    logger.info("max_model_len is %d, not the target model's %d: the %s proposer's model %r holds at most %d positions "
                "(set --max-model-len to choose another length up to that)", positions, max_model_len,
                config["method"], config.get("model"), positions)
    return positions
