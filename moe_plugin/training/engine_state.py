"""One step's checkpoint of a run, written and read back: the engine's own files (DeepSpeed's: adapters or
trainable parameters, optimizer shards, scheduler under ``engine/``; FSDP2 writes none) beside the trainer's own
state (step, losses, data position, RNG) and the layout-free trainable state (``trainable_state.py``: every
trainable tensor and its AdamW moments whole, the schedule), through ``CheckpointManager``'s atomic step
directories (``checkpoint.py``).

At the layout and engine that wrote it a checkpoint loads through the engine's own files when it has them
(bitwise what was saved); at another world, expert-parallel or context-parallel size, under the other engine
(``parallel.sharding``), or under FSDP2, through the layout-free state, resharded to this run's layout.

Nothing is unpickled: the trainer's state is JSON and safetensors, DeepSpeed's files are checked first and
load with ``weights_only=True`` (``compat/deepspeed.py``). Every function here is collective."""

from __future__ import annotations

import os
import random
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .checkpoint import CheckpointManager
from .trainer_state import read_trainer_state, write_trainer_state
from .runtime import all_ok
from .trainable_state import (
    META,
    follow_schedule,
    read_trainable,
    read_trainable_meta,
    restore_trainable,
    write_trainable,
)

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


def save_step(
    checkpoints: CheckpointManager,
    engine,
    step: int,
    rank: int,
    state: Callable[[], Dict],
    layout_free: Callable[[], Tuple[Dict[str, torch.Tensor], Dict]],
) -> str:
    """Write step ``step``'s checkpoint: ``engine``'s own files, ``state()`` the trainer's part (the RNG states
    are added), ``layout_free()`` (collective) the layout-free tensors and their metadata, which rank 0 writes.
    Returns its directory."""

    def write(staging: str) -> None:
        engine.save(staging, ENGINE_TAG)
        write_trainer_state(staging, rank, {**state(), "step": step, "rng": rng_state()})
        tensors, meta = layout_free()
        if rank == 0:
            write_trainable(staging, tensors, meta)

    return checkpoints.save(step, write)


def written_layout(path: str) -> Optional[Dict]:
    """The layout a checkpoint was written at (``trainable.json``'s, with the engine that wrote it under
    ``sharding``: "zero3" before there were two), or None for one of an earlier version (DeepSpeed's files only)."""
    if not os.path.exists(os.path.join(path, META)):
        return None
    meta = read_trainable_meta(path)
    return {**meta["layout"], "sharding": meta.get("sharding", "zero3")}


def load_latest(
    checkpoints: CheckpointManager, engine, rank: int, layout, r: int, say: Callable[[str], None]
) -> Optional[Tuple[int, str, Dict]]:
    """Load the newest complete checkpoint into ``engine`` (after removing leftovers of failed saves) and
    restore the RNG states; ``(step, directory, the trainer's state)``, or None when there is none. At the
    layout and engine that wrote it through the engine's own files where it has them; otherwise through the
    layout-free state, resharded to ``layout`` (``r``: the LoRA rank), saying so in one line (``say``, rank 0)."""
    if rank == 0:
        checkpoints.clean_leftovers()
    dist.barrier()
    latest = checkpoints.latest()
    if latest is None:
        return None
    step, path = latest
    error, state, written = None, None, None
    try:
        written = written_layout(path)
    except ValueError as e:
        error = e
    agree(error, f"another rank found a damaged file in {path} (its error names it)")
    if written is not None and (written_by(written) != written_by(_here(layout, engine)) or not engine.own_files):
        return step, path, _load_resharded(path, step, engine, rank, layout, r, written, say)
    try:  # loading runs collectives: the engine's files are checked first, so that all ranks stop alike
        engine.check_own_files(path, ENGINE_TAG, rank, dist.get_world_size())
    except ValueError as e:
        error = e
    agree(error, f"another rank found a damaged file in {path} (its error names it)")
    try:
        engine.load(path, ENGINE_TAG)
        follow_schedule(engine.optimizer, engine.lr_scheduler)  # the recipe's schedule (more steps: its new length)
        state = read_trainer_state(path, rank)
    except ValueError as e:
        error = e
    agree(error, f"another rank could not load the checkpoint {path} (its error names the file)")
    set_rng_state(state["rng"])
    return step, path, state


def written_by(layout: Dict) -> Dict:
    """What decides whether the engine's own files fit: the sizes and the engine of a checkpoint's ``layout``
    (``trainable.json``; a checkpoint of an earlier version has no ``context`` (1) nor ``sharding`` (zero3))."""
    return {
        "world": layout["world"],
        "expert": layout["expert"],
        "context": layout.get("context", 1),
        "sharding": layout.get("sharding", "zero3"),
    }


def _here(layout, engine) -> Dict:
    return {"world": layout.world, "expert": layout.expert, "context": layout.context, "sharding": engine.name}


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _load_resharded(
    path: str, step: int, engine, rank: int, layout, r: int, written: Dict, say: Callable[[str], None]
) -> Dict:
    """The layout-free state of checkpoint ``path`` into this run's layout; the trainer's state of rank 0."""
    error, tensors, meta, state = None, None, None, None
    try:
        meta, tensors = read_trainable_meta(path), read_trainable(path)
        state = read_trainer_state(path, 0)  # global: the data position, the losses, the RNG every rank seeded alike
    except ValueError as e:
        error = e
    agree(error, f"another rank could not read the layout-free state of {path} (its error names the file)")
    if rank == 0:
        was = written.get("sharding", "zero3")
        under, now = (f" under {was}", f" under {engine.name}") if was != engine.name else ("", "")
        say(
            f"resuming step {step} written at {_processes(written['world'])} EP {written['expert']}"
            f"{_cp(written.get('context', 1))}{under} on {_processes(layout.world)} EP {layout.expert}"
            f"{_cp(layout.context)}{now}"
        )
    try:
        restore_trainable(engine, tensors, meta, layout, r)
    except ValueError as e:
        error = e
    agree(error, f"another rank could not restore the layout-free state of {path} (its error says why)")
    engine.resumed_at(step, written["global_batch"])
    set_rng_state(state["rng"])
    return state


def _cp(size: int) -> str:
    return f" CP {size}" if size > 1 else ""
