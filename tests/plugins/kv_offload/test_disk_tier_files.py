"""The disk tier's start-up scan of its folder: files it did not write are left alone."""

from __future__ import annotations

import torch

from runtime_kv_offload.disk_tier import DiskTier


def test_a_stray_file_in_the_folder_does_not_stop_the_engine(tmp_path):
    first = DiskTier(str(tmp_path), 1 << 20)
    first.bind(64, "layout")
    block = torch.arange(64, dtype=torch.uint8)
    first.store(b"\x12" * 8, block)
    (tmp_path / "layout" / "12" / "notes.kvb").write_text("not a block")  # e.g. a user's or a tool's file
    (tmp_path / "layout" / "12" / "copy of 1212.kvb").write_text("")

    restarted = DiskTier(str(tmp_path), 1 << 20)
    restarted.bind(64, "layout")  # raised ValueError (non-hexadecimal number found in fromhex() arg) before
    assert restarted.hashes() == [b"\x12" * 8]
    assert torch.equal(restarted.load(b"\x12" * 8), block)
    assert (tmp_path / "layout" / "12" / "notes.kvb").exists()
