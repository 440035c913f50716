"""vLLM's --kv-transfer-config selects any installed connector by name: the TcpConnector's role,
ports and extra keys are checked with errors that name the bad value and the valid ones."""

from __future__ import annotations

import types

import pytest

from runtime.kv_transfer import kv_offload_fields, parse_transfer_config, resolve_kv_offload


def args(**overrides):
    base = dict(kv_offload=None, kv_offload_size=None, kv_offload_dir=None, kv_offload_policy=None,
                kv_transfer_config=None, preemption_mode="recompute", enable_prefix_caching=True, executor="uniproc")
    return types.SimpleNamespace(**{**base, **overrides})


def engine_config(transfer: dict):
    """Just what the TcpConnector's settings read of an EngineConfig."""
    cache = types.SimpleNamespace(kv_transfer_config=parse_transfer_config(transfer), block_size=16, cache_dtype="auto",
                                  kv_block_layout="")
    return types.SimpleNamespace(cache_config=cache)


def test_an_installed_connector_is_selected_by_name():
    raw = '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 20001, "kv_ip": "10.0.0.5"}'
    fields = kv_offload_fields(resolve_kv_offload(args(kv_transfer_config=raw)))
    assert fields["kv_connector"] == "TcpConnector"
    assert fields["kv_transfer_config"]["kv_role"] == "kv_producer" and fields["kv_transfer_config"]["kv_port"] == 20001
    assert "kv_offload" not in fields  # no tiers


def test_an_unknown_connector_names_the_installed_ones():
    with pytest.raises(ValueError, match=r"kv_connector 'NixlConnector' is not supported; supported: CudaIpcConnector, OffloadingConnector, TcpConnector"):
        parse_transfer_config({"kv_connector": "NixlConnector"})


@pytest.mark.parametrize("raw, message", [
    ({"kv_connector": "TcpConnector", "kv_role": "kv_prefill"}, r"kv_role 'kv_prefill' is not valid; choose one of: kv_producer, kv_consumer, kv_both"),
    ({"kv_connector": "TcpConnector", "kv_portt": 1}, r"unknown key\(s\) 'kv_portt'; valid keys: kv_connector, kv_role"),
    ({"kv_connector": "TcpConnector", "kv_connector_extra_config": 3}, r"kv_connector_extra_config must be a JSON object"),
    ("{not json", r"must be a JSON object"),
])
def test_bad_transfer_configs_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_transfer_config(raw)


def test_transfer_connectors_do_not_combine_with_offload_or_other_executors():
    raw = {"kv_connector": "TcpConnector"}
    with pytest.raises(ValueError, match=r"cannot be combined with --kv-offload"):
        resolve_kv_offload(args(kv_transfer_config=raw, kv_offload="cpu"))
    with pytest.raises(ValueError, match=r"uniproc executor only"):
        resolve_kv_offload(args(kv_transfer_config=raw, executor="multiproc"))


def test_tcp_connector_settings():
    from runtime_pd.settings import settings_of

    settings = settings_of(engine_config({"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_port": 20001,
                                          "kv_connector_extra_config": {"lease_s": 5, "on_transfer_failure": "fail"}}))
    assert settings.is_consumer and not settings.is_producer and settings.control_port == 20002
    assert settings.lease_s == 5.0 and settings.on_transfer_failure == "fail" and settings.host == "127.0.0.1"
    with pytest.raises(ValueError, match=r"on_transfer_failure 'retry' is not valid; choose one of: recompute, fail"):
        settings_of(engine_config({"kv_connector": "TcpConnector", "kv_connector_extra_config": {"on_transfer_failure": "retry"}}))
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) 'lease'; valid keys: lease_s"):
        settings_of(engine_config({"kv_connector": "TcpConnector", "kv_connector_extra_config": {"lease": 5}}))
