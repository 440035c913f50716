"""The CUDA platform's choice between the one-shot all-reduce and NCCL, without a GPU.

What runs on GPUs (the kernel against NCCL, in graphs, a TP=2 engine) is in
test_one_shot_all_reduce.py; here: the threshold setting, when the ranks turn it off, that they
fall back together when one of them cannot build it, which messages take it, and that the
kernel source compiles for sm_90 when nvcc is on the PATH.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
import torch

from runtime_cuda import collectives, one_shot
from runtime_cuda.collectives import ONE_SHOT_ENV, RankInfo, one_shot_max_bytes, unavailable_reason
from runtime_cuda.one_shot import MAX_BLOCKS_LIMIT, THREADS, VECTOR_BYTES, OneShotAllReduce, num_blocks, workspace_layout
from runtime_cuda.platform import CudaPlatform


def test_threshold_from_the_environment():
    assert one_shot_max_bytes({}) == collectives.DEFAULT_ONE_SHOT_MAX_BYTES
    assert one_shot_max_bytes({ONE_SHOT_ENV: " 65536 "}) == 65536
    assert one_shot_max_bytes({ONE_SHOT_ENV: "0"}) == 0
    for bad in ("64k", "-1", "1.5"):
        with pytest.raises(ValueError, match=f"{ONE_SHOT_ENV}='{bad}' is not a byte count"):
            one_shot_max_bytes({ONE_SHOT_ENV: bad})


def infos(n: int, max_bytes: int = 1 << 19, hosts=None, uuids=None) -> list[RankInfo]:
    hosts = hosts or ["node"] * n
    uuids = uuids or [f"GPU-{i}" for i in range(n)]
    return [RankInfo(h, u, max_bytes) for h, u in zip(hosts, uuids)]


def test_ranks_turn_it_off_together_for_what_it_cannot_do():
    for n in (2, 4, 8):
        assert unavailable_reason(infos(n)) is None
    for n in (3, 6, 16):
        assert unavailable_reason(infos(n)) == f"{n} ranks (the one-shot all-reduce takes 2, 4, 8)"
    mixed = infos(2)
    mixed[1] = RankInfo("node", "GPU-1", 0)  # one rank's setting of 0 wins
    assert unavailable_reason(mixed) == f"turned off ({ONE_SHOT_ENV}=0)"
    assert "2 hosts (a, b); CUDA IPC needs one" in unavailable_reason(infos(2, hosts=["b", "a"]))
    assert unavailable_reason(infos(2, uuids=["GPU-0", "GPU-0"])) == "several ranks share a GPU"


def test_workspace_holds_every_block_run_of_every_message_that_fits():
    for max_bytes, max_blocks, world in ((8 << 10, 36, 2), (512 << 10, 36, 8), (8 << 20, 36, 2), (1 << 20, 64, 4), (100_016, 7, 2)):
        region_vecs, nbytes = workspace_layout(max_bytes, max_blocks, world)
        assert nbytes == one_shot.HEADER_BYTES + 2 * world * max_blocks * region_vecs * VECTOR_BYTES
        for num_vecs in {1, 2, THREADS - 1, THREADS, THREADS + 1, 3 * THREADS, max_bytes // VECTOR_BYTES}:
            grid = num_blocks(num_vecs, max_blocks)
            assert 1 <= grid <= max_blocks
            assert -(-num_vecs // grid) <= region_vecs  # a block's run fits its region
            assert grid == min(max_blocks, -(-num_vecs // THREADS))
    with pytest.raises(ValueError, match=f"max_blocks 65 is outside 1..{MAX_BLOCKS_LIMIT}"):
        workspace_layout(1 << 20, MAX_BLOCKS_LIMIT + 1, 2)
    with pytest.raises(ValueError, match="takes 2, 4 or 8 ranks, not 3"):
        OneShotAllReduce(0, 3, 1 << 20)


def test_messages_it_takes_depend_on_size_and_dtype_only():
    reduce = OneShotAllReduce(rank=1, world_size=2, max_bytes=64 << 10)
    assert reduce.can_reduce(torch.empty(4096, dtype=torch.bfloat16))  # one decode token of an 8B model
    assert reduce.can_reduce(torch.empty(8, 4096, dtype=torch.float16)[:, ::2])  # strided: reduced in a copy
    assert reduce.can_reduce(torch.empty(16 << 10, dtype=torch.float32))  # exactly max_bytes
    assert not reduce.can_reduce(torch.empty((16 << 10) + 4, dtype=torch.float32))  # above
    assert not reduce.can_reduce(torch.empty(7, dtype=torch.bfloat16))  # not whole 16-byte vectors
    assert not reduce.can_reduce(torch.empty(0, dtype=torch.bfloat16))
    assert not reduce.can_reduce(torch.empty(64, dtype=torch.int32))  # no kernel: NCCL sums integers


class FakeOneShot:
    def __init__(self, max_bytes=1024):
        self.max_bytes, self.calls, self.closed = max_bytes, [], False

    def can_reduce(self, tensor):
        return tensor.numel() * tensor.element_size() <= self.max_bytes

    def __call__(self, tensor):
        self.calls.append(tensor.shape)
        return tensor * 2

    def close(self):
        self.closed = True


def test_platform_takes_one_shot_below_the_threshold_and_nccl_above(monkeypatch):
    nccl_calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: nccl_calls.append((tensor.shape, group)))
    group, other_group = object(), object()
    fake = FakeOneShot()
    monkeypatch.setattr(collectives, "setup_one_shot", lambda g: (fake, None) if g is group else (None, "2 hosts"))
    platform = CudaPlatform()
    assert platform.prepare_collectives(group) == "one-shot over CUDA IPC up to 1024 bytes, NCCL above"
    assert platform.prepare_collectives(other_group) == "NCCL only: 2 hosts"
    small, large = torch.ones(256), torch.ones(257)  # 1024 and 1028 bytes of float32
    assert torch.equal(platform.all_reduce(small, group), small * 2) and fake.calls == [small.shape]
    assert platform.all_reduce(large, group) is large and nccl_calls == [(large.shape, group)]
    assert platform.all_reduce(small, other_group) is small and nccl_calls[-1] == (small.shape, other_group)
    platform.destroy_collectives()
    assert fake.closed and platform.all_reduce(small, group) is small and len(nccl_calls) == 3


def gathering(monkeypatch, others: list):
    """all_gather_object as a 2-rank group where this process is rank 0 and rank 1 sends ``others`` in turn."""
    sent = iter(others)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)

    def all_gather_object(out, obj, group=None):
        out[0], out[1] = obj, next(sent)

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)


def test_a_rank_that_cannot_build_it_turns_it_off_everywhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    built = []
    monkeypatch.setattr(OneShotAllReduce, "_allocate", lambda self: (b"handle0", None))
    monkeypatch.setattr(OneShotAllReduce, "_open", lambda self, handles: built.append(handles))
    monkeypatch.setattr(OneShotAllReduce, "close", lambda self: built.append("closed"))
    gathering(monkeypatch, [(None, "CUDARuntimeError: out of memory")])
    assert OneShotAllReduce.create(None, 1 << 20) == (None, "rank 1: CUDARuntimeError: out of memory")
    assert built == ["closed"]  # never opened the peers' handles; freed its own workspace
    built.clear()
    gathering(monkeypatch, [(b"handle1", None), "OSError: peer mapping failed"])  # handles fine, mapping not
    assert OneShotAllReduce.create(None, 1 << 20) == (None, "rank 1: OSError: peer mapping failed")
    assert built == [[b"handle0", b"handle1"], "closed"]
    built.clear()
    gathering(monkeypatch, [(b"handle1", None), None])
    reduce, reason = OneShotAllReduce.create(None, 1 << 20)
    assert reason is None and (reduce.rank, reduce.world_size, reduce.max_bytes) == (0, 2, 1 << 20)


def test_setup_agrees_before_building(monkeypatch):
    monkeypatch.setattr(collectives, "local_info", lambda max_bytes: RankInfo("node", "GPU-0", max_bytes))
    monkeypatch.setattr(collectives, "peer_access_error", lambda infos, rank: None)
    monkeypatch.setattr(OneShotAllReduce, "create", classmethod(lambda cls, group, max_bytes: ("built", max_bytes)))
    monkeypatch.setenv(ONE_SHOT_ENV, "4096")
    gathering(monkeypatch, [RankInfo("node", "GPU-1", 8192), None])  # its info, then its peer access: fine
    assert collectives.setup_one_shot(None) == ("built", 4096)  # the smaller threshold of the two
    gathering(monkeypatch, [RankInfo("other-node", "GPU-1", 8192)])
    assert "CUDA IPC needs one" in collectives.setup_one_shot(None)[1]
    gathering(monkeypatch, [RankInfo("node", "GPU-1", 8192), "GPU 1 has no peer access to GPU 0 (rank 0)"])
    assert collectives.setup_one_shot(None) == (None, "rank 1: GPU 1 has no peer access to GPU 0 (rank 0)")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_kernel_source_compiles_for_hopper(tmp_path):
    source = tmp_path / "instances.cu"
    lines = [f'#include "{one_shot.__file__.replace(".py", ".cu")}"']
    for name in one_shot.KERNEL_TYPES.values():
        for ranks, push in itertools.product((2, 4, 8), ("true", "false")):
            lines.append(f"template __global__ void one_shot::all_reduce<{name}, {ranks}, {push}>"
                         "(uint4*, const unsigned long long*, int, int, int, int);")
    source.write_text("\n".join(lines) + "\n")
    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(tmp_path / "k.cubin"), str(source)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
