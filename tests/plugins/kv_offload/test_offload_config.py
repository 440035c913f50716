"""Offload flags: sizes with units, tiers, directory, policy, vLLM's --kv-transfer-config,
swap preemption, and clear start-up errors naming the bad value and the valid ones."""

from __future__ import annotations

import argparse
import os

import pytest

from runtime.cli.args import add_engine_args, engine_args_from_namespace
from runtime.kv_transfer import DEFAULT_TIER_SIZES, parse_size, resolve_kv_offload


def args(**kwargs):
    values = dict(kv_offload=None, kv_offload_size=None, kv_offload_dir=None, kv_offload_policy=None,
                  kv_transfer_config=None, preemption_mode="recompute", enable_prefix_caching=True, executor="uniproc")
    values.update(kwargs)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096B", 4096), ("64 KiB", 64 << 10),
    ("2", 2 << 30), (0.5, 1 << 29),
])
def test_sizes_with_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8 parsecs", "GiB", "-1GiB", "0", "1e3"])
def test_bad_size_names_the_value_and_the_units(bad):
    with pytest.raises(ValueError, match="kv-offload-size") as info:
        parse_size(bad)
    assert repr(bad) in str(info.value) or "larger than zero" in str(info.value)


def test_tiers_sizes_dir_and_policy(tmp_path):
    resolved = resolve_kv_offload(args(kv_offload="cpu,disk", kv_offload_size="8MiB,64MiB", kv_offload_dir=str(tmp_path),
                                       kv_offload_policy="arc"))
    assert resolved == {"connector": "OffloadingConnector", "tiers": ("cpu", "disk"), "sizes": (8 << 20, 64 << 20),
                        "dir": str(tmp_path), "policy": "arc"}
    default = resolve_kv_offload(args(kv_offload="cpu"))
    assert default["sizes"] == (DEFAULT_TIER_SIZES["cpu"],) and default["policy"] == "lru"
    assert resolve_kv_offload(args()) is None


def test_unknown_tier_lists_the_installed_ones():
    with pytest.raises(ValueError, match=r"--kv-offload: unknown kv tier 'gpu'; installed: cpu, disk"):
        resolve_kv_offload(args(kv_offload="cpu,gpu"))


def test_more_sizes_than_tiers_and_bad_policy(tmp_path):
    with pytest.raises(ValueError, match=r"2 sizes for 1 tier\(s\) \(cpu\)"):
        resolve_kv_offload(args(kv_offload="cpu", kv_offload_size="1GiB,2GiB"))
    with pytest.raises(ValueError, match=r"--kv-offload-policy 'mru' is not valid; choose one of: lru, arc"):
        resolve_kv_offload(args(kv_offload="cpu", kv_offload_policy="mru"))


def test_disk_tier_needs_a_writable_directory(tmp_path):
    with pytest.raises(ValueError, match="add --kv-offload-dir PATH"):
        resolve_kv_offload(args(kv_offload="disk"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"--kv-offload-dir '.*file/sub' is not a writable directory"):
        resolve_kv_offload(args(kv_offload="disk", kv_offload_dir=str(blocker / "sub")))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not a writable directory"):
            resolve_kv_offload(args(kv_offload="disk", kv_offload_dir=str(locked)))


def test_a_directory_without_the_disk_tier_is_refused(tmp_path):
    # `--kv-offload cpu --kv-offload-dir X` used to run with no disk tier at all, silently
    with pytest.raises(ValueError, match=r"--kv-offload-dir '.*' is for the disk tier, which --kv-offload cpu does not "
                                         r"list; add it \(e.g. --kv-offload cpu,disk\)"):
        resolve_kv_offload(args(kv_offload="cpu", kv_offload_dir=str(tmp_path)))
    assert resolve_kv_offload(args(kv_offload="cpu,disk", kv_offload_dir=str(tmp_path)))["dir"] == str(tmp_path)


def test_vllm_kv_transfer_config_spelling(tmp_path):
    config = ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
              f'{{"tiers": "cpu,disk", "size": "1GiB,2GiB", "dir": "{tmp_path}", "policy": "arc"}}}}')
    resolved = resolve_kv_offload(args(kv_transfer_config=config))
    assert resolved["tiers"] == ("cpu", "disk") and resolved["sizes"] == (1 << 30, 2 << 30) and resolved["policy"] == "arc"
    blocks = resolve_kv_offload(args(kv_transfer_config={"kv_connector": "OffloadingConnector",
                                                         "kv_connector_extra_config": {"num_cpu_blocks": 100}}))
    assert blocks["tiers"] == ("cpu",) and blocks["sizes"] == (-100,)  # the cpu tier turns blocks into bytes
    with pytest.raises(ValueError, match=r"kv_connector 'LMCacheConnectorV1' is not supported; supported: (\w+, )*OffloadingConnector"):
        resolve_kv_offload(args(kv_transfer_config={"kv_connector": "LMCacheConnectorV1"}))
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) 'speed'"):
        resolve_kv_offload(args(kv_transfer_config={"kv_connector": "OffloadingConnector",
                                                    "kv_connector_extra_config": {"speed": 1}}))


def test_swap_needs_a_cpu_tier_and_offload_needs_hashes(tmp_path):
    with pytest.raises(ValueError, match="--preemption-mode swap .* add --kv-offload cpu"):
        resolve_kv_offload(args(preemption_mode="swap"))
    with pytest.raises(ValueError, match="--preemption-mode swap"):
        resolve_kv_offload(args(preemption_mode="swap", kv_offload="disk", kv_offload_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        resolve_kv_offload(args(kv_offload="cpu", enable_prefix_caching=False))


def test_cli_flags_reach_the_engine_args(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-offload", "cpu,disk", "--kv-offload-size", "8GiB,64GiB", "--kv-offload-dir", str(tmp_path),
                            "--kv-offload-policy", "arc", "--preemption-mode", "swap",
                            "--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'])
    engine_args = engine_args_from_namespace(ns)
    assert (engine_args.kv_offload, engine_args.kv_offload_size, engine_args.preemption_mode) == ("cpu,disk", "8GiB,64GiB", "swap")
    assert engine_args.kv_transfer_config == {"kv_connector": "OffloadingConnector"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "swapp"])


def test_engine_start_up_fails_with_the_bad_value(model_path, tmp_path):
    from runtime import LLM

    with pytest.raises(ValueError, match=r"unknown kv tier 'nvme'; installed: cpu, disk"):
        LLM(model_path, skip_tokenizer_init=True, kv_offload="nvme")
    with pytest.raises(ValueError, match=r"bad size '8 GB!'"):
        LLM(model_path, skip_tokenizer_init=True, kv_offload="cpu", kv_offload_size="8 GB!")
    with pytest.raises(ValueError, match=r"holds no block; one block takes 2048 bytes"):
        LLM(model_path, skip_tokenizer_init=True, dtype="float32", block_size=4, kv_offload="cpu", kv_offload_size="1KiB")


def test_an_empty_size_keeps_that_tiers_default(tmp_path):
    resolved = resolve_kv_offload(args(kv_offload="cpu,disk", kv_offload_size=",64MiB", kv_offload_dir=str(tmp_path)))
    assert resolved["sizes"] == (DEFAULT_TIER_SIZES["cpu"], 64 << 20)
    resolved = resolve_kv_offload(args(kv_offload="cpu,disk", kv_offload_size="8MiB,", kv_offload_dir=str(tmp_path)))
    assert resolved["sizes"] == (8 << 20, DEFAULT_TIER_SIZES["disk"])


@pytest.mark.parametrize("key, value", [("num_cpu_blocks", 0), ("num_cpu_blocks", -5), ("num_cpu_blocks", "abc"),
                                        ("num_cpu_blocks", True), ("cpu_bytes_to_use", "x"), ("cpu_bytes_to_use", 0)])
def test_extra_config_sizes_must_be_positive_integers(key, value):
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {key: value}}
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config {key} must be a positive integer, got {value!r}"):
        resolve_kv_offload(args(kv_transfer_config=config))


def test_the_cpu_tiers_size_given_twice_is_refused():
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 100}}
    with pytest.raises(ValueError, match=r"the cpu tier's size is given 2 times \(--kv-offload-size, num_cpu_blocks\)"):
        resolve_kv_offload(args(kv_offload="cpu", kv_offload_size="1GiB", kv_transfer_config=config))
    both = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 100, "cpu_bytes_to_use": 1 << 20}}
    with pytest.raises(ValueError, match=r"given 2 times \(num_cpu_blocks, cpu_bytes_to_use\)"):
        resolve_kv_offload(args(kv_transfer_config=both))
    alone = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    assert resolve_kv_offload(args(kv_transfer_config=alone))["sizes"] == (1 << 20,)
