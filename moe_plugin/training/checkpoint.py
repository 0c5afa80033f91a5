"""Training checkpoints that are atomic across ranks: a save killed on any rank at any moment leaves the
previous complete checkpoint as the latest one, with its files unchanged.

Layout under ``root`` (``<output_dir>/checkpoints``)::

    step-00000010/           a complete checkpoint: every rank's files, rank{r}.done per rank, COMPLETE
    .staging-step-00000020/  a save under way, or what a killed one left
    .pruning-step-00000000/  an old checkpoint being removed

A checkpoint counts only with its ``COMPLETE`` marker (JSON: ``step``, ``world_size`` and ``files``, every
file's path relative to the checkpoint and size in bytes), which rank 0 writes last, after it has checked
every rank's files, and before one rename makes the staging directory ``step-<8 digits>``. Until that rename
nothing outside the staging directory changes; after it, old checkpoints are first renamed to
``.pruning-...`` (out of ``latest()``'s sight in one step) and then removed. ``clean_leftovers()`` removes
what a killed save left: staging and pruning directories, and step directories whose marker is missing or
does not match their files.

The ranks must see ``root`` on one shared file system.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import require
from ..fileio import fsync_path

COMPLETE = "COMPLETE"
_STEP = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"\.(staging|pruning)-step-\d+")
_RANK_MARKER = re.compile(r"rank\d+\.done")
_MARKER_BEING_WRITTEN = re.compile(r"\.(COMPLETE|rank\d+\.done)\.tmp-\d+")


def step_name(step: int) -> str:
    """``step-00000010``: the directory name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


def distributed_all_ok(ok: bool) -> bool:
    """True on every rank when ``ok`` is True on every rank of the default process group (a MAX all-reduce
    of a failure flag, on the GPU under NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return int(failed.item()) == 0


def _identity(ok: bool) -> bool:
    return ok


class CheckpointManager:
    """Saves into ``root``, finds the newest complete checkpoint, removes what killed saves left.

    ``rank``/``world_size``: this process's place among the ranks that save together. ``barrier``: waits
    for every rank (``torch.distributed.barrier``). ``keep``: how many complete checkpoints a save leaves.
    ``all_ok``: combines the ranks' success flags (True only if all are True); by default an all-reduce
    over torch.distributed when it is initialised, and for a single rank the flag itself.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        keep: int = 2,
        all_ok: Optional[Callable[[bool], bool]] = None,
    ):
        require(
            isinstance(world_size, int) and world_size >= 1,
            "CheckpointManager.world_size",
            f"must be a positive integer, got {world_size!r}",
        )
        require(
            isinstance(rank, int) and 0 <= rank < world_size,
            "CheckpointManager.rank",
            f"must be an integer in [0, world_size={world_size}), got {rank!r}",
        )
        require(
            isinstance(keep, int) and keep >= 1,
            "CheckpointManager.keep",
            f"must be a positive integer (the newest checkpoints to keep), got {keep!r}",
        )
        require(callable(barrier), "CheckpointManager.barrier", f"must be callable, got {barrier!r}")
        if all_ok is None:
            if dist.is_available() and dist.is_initialized():
                all_ok = distributed_all_ok
            else:
                require(
                    world_size == 1,
                    "CheckpointManager.all_ok",
                    f"world_size is {world_size} but torch.distributed is not initialised, so a failure "
                    "on one rank could not stop the others: initialise it first or pass an all_ok "
                    "callable that is True only when every rank's flag is",
                )
                all_ok = _identity
        require(callable(all_ok), "CheckpointManager.all_ok", f"must be callable, got {all_ok!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.barrier, self.all_ok = barrier, all_ok

    # ---------------------------------------------------------------- saving

    def save(self, step: int, write: Callable[[str], Optional[Iterable[str]]]) -> str:
        """Save checkpoint ``step``; every rank calls it. Returns the checkpoint's path.

        ``write(staging_dir)`` writes this rank's files into ``root/.staging-step-<step>`` (the same directory
        on every rank) and may return the paths it wrote (absolute, or relative to that directory); when it
        returns None this rank vouches for every file there once all ranks have written. Each rank then
        fsyncs its files and records them with their sizes in ``rank{r}.done``; rank 0 checks every rank's
        record against the files, writes ``COMPLETE``, renames the directory to ``step-<step>`` and prunes to
        the ``keep`` newest complete checkpoints. A failure on any rank raises on every rank (the failing
        one re-raises its own error, the others RuntimeError), and before the rename it leaves the previous
        checkpoints as they were. ValueError when ``root`` already holds a complete checkpoint of this or a
        later step (``latest()`` would not return the new one).
        """
        require(
            isinstance(step, int) and not isinstance(step, bool) and step >= 0,
            "step",
            f"must be a non-negative integer, got {step!r}",
        )
        require(callable(write), "write", f"must be callable with the staging directory, got {write!r}")
        final = os.path.join(self.root, step_name(step))
        staging = os.path.join(self.root, f".staging-{step_name(step)}")
        nothing_published = "no checkpoint was published and the previous ones are untouched"
        self._agree(
            step,
            staging,
            "preparing",
            f"rank 0 could not prepare {staging}; {nothing_published}",
            (lambda: self._prepare(step, staging, final)) if self.rank == 0 else None,
        )
        written: List[Optional[Iterable[str]]] = []
        self._agree(
            step,
            staging,
            "writing",
            f"another rank failed while writing; {nothing_published}",
            lambda: written.append(write(staging)),
        )
        self._agree(
            step,
            staging,
            "recording",
            f"another rank failed to record its files; {nothing_published}",
            lambda: self._record(staging, written[0]),
        )
        self._agree(
            step,
            staging,
            "publishing",
            f"rank 0 could not verify or publish {final}; {nothing_published}",
            (lambda: self._publish(step, staging, final)) if self.rank == 0 else None,
        )
        self._agree(
            step,
            None,
            "pruning",
            f"{final} was saved, but rank 0 could not remove older checkpoints",
            self._prune if self.rank == 0 else None,
        )
        return final

    def _agree(
        self, step: int, staging: Optional[str], phase: str, others_message: str, action: Optional[Callable[[], object]]
    ) -> None:
        """Run this rank's part of a phase, then wait for all ranks; raise on every rank if any failed."""
        error: Optional[BaseException] = None
        if action is not None:
            try:
                action()
            except Exception as exc:  # reported to every rank below; a kill or Ctrl-C goes straight up
                error = exc
        self.barrier()
        if self.all_ok(error is None):
            return
        if self.rank == 0 and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)  # every rank has left the phase: nobody writes there
        if error is not None:
            raise error
        raise RuntimeError(f"checkpoint {step_name(step)}: {phase} failed: {others_message}")

    def _prepare(self, step: int, staging: str, final: str) -> None:
        for existing, path in self._complete_checkpoints():
            require(
                existing < step,
                "step",
                f"{self.root} already holds the complete checkpoint {os.path.basename(path)}, not older "
                f"than step {step}, so latest() would not return the new one: remove the later "
                "checkpoints (when resuming from an earlier one) or save a later step",
            )
        os.makedirs(self.root, exist_ok=True)
        if os.path.lexists(final) and _problem(final, step) != _NO_MARKER:  # a damaged checkpoint of this step:
            _set_aside(final)  # kept beside the new one, never removed
        for debris in (staging, final):  # what a killed save of this step left (final: without a marker)
            if os.path.lexists(debris):
                _remove(debris)
        os.mkdir(staging)

    def _record(self, staging: str, returned: Optional[Iterable[str]]) -> None:
        if returned is None:
            listing = sorted(_files(staging, with_markers=False))
            own = listing[self.rank :: self.world_size]  # each rank flushes a share of what all wrote
        else:
            listing = own = sorted({_inside(staging, path) for path in returned})
        for path in own:
            fsync_path(os.path.join(staging, path))
        sizes = {path: os.path.getsize(os.path.join(staging, path)) for path in listing}
        _write_json_durably(os.path.join(staging, f"rank{self.rank}.done"), {"rank": self.rank, "files": sizes})

    def _publish(self, step: int, staging: str, final: str) -> None:
        present = _files(staging, with_markers=True)
        for rank in range(self.world_size):
            marker = os.path.join(staging, f"rank{rank}.done")
            if not os.path.isfile(marker):
                raise RuntimeError(f"checkpoint {step_name(step)}: rank {rank} left no {marker}")
            with open(marker) as f:
                record = json.load(f)
            if record.get("rank") != rank:
                raise RuntimeError(f"checkpoint {step_name(step)}: {marker} is marked rank {record.get('rank')!r}")
            listed: Dict[str, int] = record["files"]
            for path, size in listed.items():
                if present.get(path) != size:
                    found = "missing" if path not in present else f"{present[path]} bytes"
                    raise RuntimeError(
                        f"checkpoint {step_name(step)}: rank {rank} wrote {path} of {size} bytes, "
                        f"rank 0 finds it {found} in {staging}"
                    )
        _write_json_durably(
            os.path.join(staging, COMPLETE), {"step": step, "world_size": self.world_size, "files": present}
        )
        for directory, _, _ in os.walk(staging):
            fsync_path(directory)
        os.rename(staging, final)  # the last step: a failure up to here publishes nothing

    def _prune(self) -> None:
        for _, path in self._complete_checkpoints()[self.keep :]:
            aside = os.path.join(self.root, f".pruning-{os.path.basename(path)}")
            os.rename(path, aside)  # out of latest()'s sight at once, however long the removal takes
            _remove(aside)
        fsync_path(self.root)  # makes the rename to step-<step> durable as well

    # ---------------------------------------------------------------- reading and cleaning

    def latest(self) -> Optional[Tuple[int, str]]:
        """``(step, path)`` of the newest complete checkpoint in ``root``, or None."""
        for step, path in self._step_directories():
            if _is_complete(path, step):
                return step, path
        return None

    def clean_leftovers(self) -> List[str]:
        """Remove what killed saves left in ``root``: ``.staging-*`` and ``.pruning-*`` directories and step
        directories without a ``COMPLETE`` marker. A step directory whose marker exists but does not match its
        files (``damaged()``: changed after it was saved) is left as it is; a later save of its step sets it
        aside as ``.damaged-step-*``. Only rank 0 removes anything (the others return []); entries of ``root``
        named otherwise are never touched. Call it at start-up, before the first save. Returns the paths
        removed."""
        if self.rank != 0 or not os.path.isdir(self.root):
            return []
        removed = [os.path.join(self.root, e) for e in os.listdir(self.root) if _LEFTOVER.fullmatch(e)]
        # a step directory with a marker that no longer matches was changed after it was saved: left as it is
        removed += [path for step, path in self._step_directories() if _problem(path, step) == _NO_MARKER]
        for path in removed:
            _remove(path)
        return sorted(removed)

    def damaged(self) -> List[str]:
        """What is wrong with each step directory whose ``COMPLETE`` marker exists but does not match its files
        (a save never leaves one: something changed it since), newest first."""
        found = [_problem(path, step) for step, path in self._step_directories()]
        return [problem for problem in found if problem is not None and problem != _NO_MARKER]

    def _step_directories(self) -> List[Tuple[int, str]]:
        """``(step, path)`` of every entry named like a checkpoint, newest first."""
        if not os.path.isdir(self.root):
            return []
        found = [
            (int(m.group(1)), os.path.join(self.root, e)) for e in os.listdir(self.root) if (m := _STEP.fullmatch(e))
        ]
        return sorted(found, reverse=True)

    def _complete_checkpoints(self) -> List[Tuple[int, str]]:
        return [(step, path) for step, path in self._step_directories() if _is_complete(path, step)]


_NO_MARKER = "has no COMPLETE marker"


def _problem(path: str, step: int) -> Optional[str]:
    """None when ``path`` holds a ``COMPLETE`` marker for ``step`` whose every listed file is there, of the
    listed size; else what is wrong, naming the file."""
    marker_path = os.path.join(path, COMPLETE)
    if not os.path.lexists(marker_path):
        return _NO_MARKER
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        files = marker["files"]
        if marker["step"] != step or not isinstance(files, dict):
            return f"{marker_path} is for step {marker['step']!r}, not {step}, or lists no files"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{marker_path} is not a valid marker ({type(err).__name__}: {err})".replace("\n", " ")
    for name, size in files.items():
        file = os.path.join(path, str(name))
        if not os.path.isfile(file) or os.path.relpath(file, path).startswith(os.pardir):
            return f"{file} is missing (its COMPLETE marker lists it)"
        if os.path.getsize(file) != size:
            return f"{file} is {os.path.getsize(file)} bytes, its COMPLETE marker lists {size}"
    return None


def _is_complete(path: str, step: int) -> bool:
    return _problem(path, step) is None


def _inside(directory: str, path: str | os.PathLike) -> str:
    """``path`` (absolute, or relative to ``directory``) relative to ``directory``; ValueError unless it is a
    file inside it."""
    relative = os.path.relpath(os.path.join(directory, os.fspath(path)), directory)
    if (
        relative.startswith(os.pardir)
        or os.path.isabs(relative)
        or not os.path.isfile(os.path.join(directory, relative))
    ):
        raise ValueError(f"write: returned {os.fspath(path)!r}, which is not a file inside {directory}")
    return relative


def _files(directory: str, with_markers: bool) -> Dict[str, int]:
    """``{path relative to directory: size}`` of every file under ``directory``: the rank markers only
    ``with_markers``, never COMPLETE nor a marker still being written (those are top-level names)."""
    sizes = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            if parent == directory and (
                name == COMPLETE
                or _MARKER_BEING_WRITTEN.fullmatch(name)
                or (not with_markers and _RANK_MARKER.fullmatch(name))
            ):
                continue
            path = os.path.join(parent, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return sizes


def _write_json_durably(path: str, value: object) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _set_aside(path: str) -> str:
    """Rename a damaged step directory to ``.damaged-step-<8 digits>[-k]`` beside it (out of ``latest()``'s and
    ``clean_leftovers()``'s sight, its files untouched); returns the new path."""
    parent, name = os.path.split(path)
    target, k = os.path.join(parent, f".damaged-{name}"), 1
    while os.path.lexists(target):
        target, k = os.path.join(parent, f".damaged-{name}-{k}"), k + 1
    os.rename(path, target)
    return target


def _remove(path: str) -> None:
    """Remove an entry of ``root`` named like ours; a symlink goes, never what it points to."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.remove(path)
    else:
        shutil.rmtree(path)
