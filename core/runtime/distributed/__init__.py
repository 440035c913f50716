"""Parallel state of a worker: its ranks, its process groups and the collectives models use.

A single-worker engine never initializes it: every rank is 0, every size 1, and the
collectives return their input, so the models run unchanged. A multi-worker executor calls
:func:`init_distributed` once in each worker process before the model is built.
"""

from runtime.distributed.parallel_state import (
    ParallelState,
    broadcast_from_last_stage,
    destroy_distributed,
    get_parallel_state,
    init_distributed,
    pp_rank,
    pp_recv,
    pp_send,
    pp_size,
    tp_all_gather,
    tp_all_reduce,
    tp_rank,
    tp_size,
)

__all__ = [
    "ParallelState",
    "broadcast_from_last_stage",
    "destroy_distributed",
    "get_parallel_state",
    "init_distributed",
    "pp_rank",
    "pp_recv",
    "pp_send",
    "pp_size",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_rank",
    "tp_size",
]
