"""Rank-side code of test_checkpoint.py (run by run_distributed with a gloo process group)."""

import os
import signal

import torch
import torch.distributed as dist

from moe_plugin.training.checkpoint import CheckpointManager


def shard_name(rank: int) -> str:
    return os.path.join("global_step", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def shard_values(step: int, rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) + 100 * step + rank


def writer(step: int, rank: int, seen: list, return_files: bool):
    """As DeepSpeed's save_checkpoint and the trainer write: a shard per rank, and the trainer state on rank 0."""

    def write(staging):
        seen.append(staging)
        os.makedirs(os.path.join(staging, "global_step"), exist_ok=True)
        torch.save({"step": step, "values": shard_values(step, rank)}, os.path.join(staging, shard_name(rank)))
        files = [shard_name(rank)]
        if rank == 0:
            with open(os.path.join(staging, "trainer_state.json"), "w") as f:
                f.write(f'{{"step": {step}}}')
            files.append(os.path.join(staging, "trainer_state.json"))  # absolute paths are accepted too
        return files if return_files else None

    return write


def save_twice_then_fail(root: str) -> dict:
    """Save steps 10 (write returns nothing) and 20 (write returns its files), then step 30 with a write that
    raises on rank 1 only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manager = CheckpointManager(root, rank, world, dist.barrier, keep=2)
    seen = []
    paths = [
        manager.save(10, writer(10, rank, seen, return_files=False)),
        manager.save(20, writer(20, rank, seen, return_files=True)),
    ]

    def fail_on_rank_1(staging):
        writer(30, rank, seen, return_files=False)(staging)
        if rank == 1:
            raise OSError("disk full on rank 1")

    try:
        manager.save(30, fail_on_rank_1)
        failure = None
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    return {"paths": paths, "staging_seen": seen, "failure": failure, "latest": manager.latest()}


def save_and_die(root: str) -> None:
    """Save step 30; rank 1 SIGKILLs itself after writing its first file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manager = CheckpointManager(root, rank, world, dist.barrier, keep=2)

    def write(staging):
        writer(30, rank, [], return_files=False)(staging)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    manager.save(30, write)
