"""Which tensor- and pipeline-parallel sizes a model's shape allows, checked before any worker starts.

A worker splits the attention heads, the KV heads (or replicates each over ``tp / num_kv_heads``
ranks when there are fewer KV heads than ranks) and the MLP's intermediate size over its stage's
ranks, and a pipeline stage holds at least one decoder layer. A size that breaks one of these
would only fail inside the worker processes, seconds later and as a traceback; refused here, the
error names the size and the valid ones. A config without these fields is not checked.
"""

from __future__ import annotations


def _text_config(hf_config):
    get_text_config = getattr(hf_config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else hf_config


def _positive_int(config, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def valid_tensor_parallel_sizes(hf_config) -> list[int] | None:
    """The tensor-parallel sizes that split the model's heads and MLP evenly; None if its config does not say."""
    config = _text_config(hf_config)
    num_heads = _positive_int(config, "num_attention_heads")
    if num_heads is None:
        return None
    num_kv_heads = _positive_int(config, "num_key_value_heads") or num_heads
    intermediate_size = _positive_int(config, "intermediate_size")

    def splits(tp: int) -> bool:
        return (
            num_heads % tp == 0
            and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)
            and (intermediate_size is None or intermediate_size % tp == 0)
        )

    return [tp for tp in range(1, num_heads + 1) if splits(tp)]


def check_parallel_layout(hf_config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Raise ``ValueError`` naming the size and the valid ones if the model cannot be split so."""
    if hf_config is None:
        return
    config = _text_config(hf_config)
    valid = valid_tensor_parallel_sizes(config)
    if valid is not None and tensor_parallel_size not in valid:
        num_heads = config.num_attention_heads
        num_kv_heads = _positive_int(config, "num_key_value_heads") or num_heads
        intermediate_size = _positive_int(config, "intermediate_size")
        mlp = f" and an MLP of {intermediate_size}" if intermediate_size is not None else ""
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} does not split the model's {num_heads} attention heads "
            f"({num_kv_heads} KV heads){mlp} evenly; valid: {', '.join(map(str, valid))}"
        )
    num_layers = _positive_int(config, "num_hidden_layers")
    if num_layers is not None and pipeline_parallel_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pipeline_parallel_size} is more than the model's {num_layers} decoder layers "
            f"(each stage holds at least one); valid: 1 to {num_layers}"
        )
