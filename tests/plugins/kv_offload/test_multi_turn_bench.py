"""``runtime bench multi-turn``: one small run per offload mode, and its table."""

from __future__ import annotations

import argparse

from runtime.bench import multi_turn


def test_bench_compares_later_turns_with_and_without_the_cpu_tier(model_path, capsys):
    parser = argparse.ArgumentParser()
    multi_turn.add_arguments(parser)
    args = parser.parse_args([
        "--model", model_path, "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "4",
        "--num-conversations", "4", "--num-turns", "3", "--system-len", "40", "--user-len", "8", "--output-len", "4",
        "--offload-modes", "none,cpu", "--think-time", "1.0", "--pool-conversations", "1",
    ])
    assert multi_turn.main(args) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["none"], ["cpu"])}
    assert set(rows) == {"none", "cpu"}
    from_tiers = {mode: int(row[5]) for mode, row in rows.items()}
    assert from_tiers["none"] == 0 and from_tiers["cpu"] > 0
    assert int(rows["cpu"][4]) > int(rows["none"][4])  # later turns find more of their prompt cached
    assert rows["none"][7] == "1.00x"
    loaded_gb = {mode: float(row[8]) for mode, row in rows.items()}
    assert loaded_gb["none"] == 0.0 and float(rows["none"][9]) == 0.0
    assert float(rows["cpu"][8]) >= 0.0 and float(rows["cpu"][9]) >= 0.0  # tiny blocks: their GB round to 0.00
