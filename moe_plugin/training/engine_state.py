"""One step's checkpoint of a run, written and read back: DeepSpeed's engine files (adapters or trainable
parameters, optimizer shards, scheduler) under ``engine/`` beside the trainer's own state (step, losses, data
position, RNG), through ``CheckpointManager``'s atomic step directories (``checkpoint.py``).

Nothing is unpickled: the trainer's state is JSON and safetensors, the engine's files are checked first and
load with ``weights_only=True`` (``compat/deepspeed.py``). Every function here is collective."""

from __future__ import annotations

import os
import random
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..compat.deepspeed import check_engine_files, safe_checkpoint_loading
from .checkpoint import CheckpointManager, read_trainer_state, write_trainer_state
from .runtime import all_ok

__all__ = ["ENGINE_TAG", "rng_state", "set_rng_state", "agree", "save_step", "load_latest"]

ENGINE_TAG = "engine"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def agree(error: Optional[BaseException], others: str) -> None:
    """Raise on every rank when any rank has an ``error`` (a collective): its own, or ``others`` as a
    ValueError, so that the commands report it in one line on the ranks that only waited (the failing rank's
    own message names the input)."""
    if not all_ok(error is None):
        raise error if error is not None else ValueError(others)


def save_step(checkpoints: CheckpointManager, engine, step: int, rank: int, state: Callable[[], Dict]) -> str:
    """Write step ``step``'s checkpoint; ``state()`` gives the trainer's part (the RNG states are added).
    Returns its directory."""

    def write(staging: str) -> None:
        engine.save_checkpoint(staging, tag=ENGINE_TAG, exclude_frozen_parameters=True, save_latest=False)
        write_trainer_state(staging, rank, {**state(), "step": step, "rng": rng_state()})

    return checkpoints.save(step, write)


def load_latest(checkpoints: CheckpointManager, engine, rank: int) -> Optional[Tuple[int, str, Dict]]:
    """Load the newest complete checkpoint into ``engine`` (after removing leftovers of failed saves) and
    restore the RNG states; ``(step, directory, the trainer's state)``, or None when there is none."""
    if rank == 0:
        checkpoints.clean_leftovers()
    dist.barrier()
    latest = checkpoints.latest()
    if latest is None:
        return None
    step, path = latest
    error, state = None, None
    try:  # engine.load_checkpoint runs collectives: its files are checked first, so that all ranks stop alike
        check_engine_files(os.path.join(path, ENGINE_TAG), rank, dist.get_world_size())
    except ValueError as e:
        error = e
    agree(error, f"another rank found a damaged file in {path} (its error names it)")
    try:
        with safe_checkpoint_loading():
            engine.load_checkpoint(path, tag=ENGINE_TAG, load_module_strict=False,
                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        state = read_trainer_state(path, rank)
    except ValueError as e:
        error = e
    agree(error, f"another rank could not load the checkpoint {path} (its error names the file)")
    set_rng_state(state["rng"])
    return step, path, state
