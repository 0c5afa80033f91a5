"""Rank-side functions for test_parallel_launch.py."""

import os
import sys
import time

import torch
import torch.distributed as dist

IMPORT_DELAY_ENV = "LAUNCH_WORKERS_IMPORT_DELAY_S"
if "RANK" in os.environ:  # a slow start-up in the ranks only (the parent imports this file too)
    time.sleep(float(os.environ.get(IMPORT_DELAY_ENV, "0")))


def report(offset: int = 0) -> dict:
    """What a rank sees: its rank, the world, one all-reduce, its thread settings, devices and group timeout."""
    total = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(total)
    group = dist.distributed_c10d._get_default_group()
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": total.item(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "tensor": torch.full((2,), float(dist.get_rank())),
        "backend": dist.get_backend(),
        "cuda": torch.cuda.is_available(),
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "group_timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }


def fail_on(rank: int) -> None:
    """Raise on ``rank`` once every rank has started; the others then wait outside any collective (so
    nothing makes them fail) until the launcher stops them."""
    print(f"rank {dist.get_rank()} started", file=sys.stderr, flush=True)
    dist.barrier()
    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    while True:
        time.sleep(1)


def stall_on(rank: int) -> None:
    """``rank`` never reaches the barrier (it is alive, not failed); the others wait there until the
    process-group timeout makes their barrier raise."""
    if dist.get_rank() == rank:
        print(f"rank {rank} stalls", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    dist.barrier()


def sleep_forever() -> None:
    print(f"rank {os.environ['RANK']} sleeps", file=sys.stderr, flush=True)
    while True:
        time.sleep(1)
