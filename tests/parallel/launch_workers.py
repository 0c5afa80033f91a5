"""Rank-side functions for test_parallel_launch.py."""

import os

import torch
import torch.distributed as dist


def report(offset: int = 0) -> dict:
    """What a rank sees: its rank, the world, one all-reduce, its thread settings."""
    total = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(),
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "tensor": torch.full((2,), float(dist.get_rank()))}


def fail_on(rank: int) -> None:
    """Raise on ``rank``; the others wait in a barrier that never completes, until the launcher stops them."""
    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()


def sleep_forever() -> None:
    import time

    while True:
        time.sleep(1)
