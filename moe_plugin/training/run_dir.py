"""The output directory of a run: claimed before training so that ``output_dir`` can never destroy data.

Rank 0 claims it (the trainer barriers after). A claim refuses paths whose loss would hurt (the current
directory and its parents, the home directory, the filesystem root), existing files, and non-empty
directories that are not a run of this project; a run directory is marked by ``moe_plugin_run.json``, which
holds the recipe. Claiming a marked directory resumes it, if the recipe is the same run. While a run owns the
directory it holds an ``flock`` on ``output_dir/.lock``; the kernel drops that lock when its process dies, so a
crashed run never blocks the next one. Nothing that was in the directory before is ever deleted.

A marked directory that holds no training output yet (no checkpoint, ``adapter/``, ``model/``, ``losses.json``
or ``results.json``: a run that failed before its first step) is claimed by any recipe, which rewrites the
marker, so that a corrected recipe can reuse it. ``refuse_overwriting_outputs`` keeps a finished run's outputs
from being trained over when none of its checkpoints can be resumed.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

from ..output_paths import check_output_dir
from .checkpoint import COMPLETE
from .inputs import check_inputs, fingerprint_inputs, read_recorded_inputs, write_recorded_inputs

MARKER = "moe_plugin_run.json"
OVERRIDE_FLAG = "--allow-changed-inputs"  # moe-plugin train's flag for allow_changed_inputs
LOCK = ".lock"
_PROBE = ".moe_plugin_write_probe"
# a resume may train longer, evaluate or log differently; output_dir names this same directory either way; and it
# may run on another layout (its micro-batch, accumulation and DeepSpeed config with it), the global batch kept
# (check_resume_layout), and under the other engine (the layout-free state is every engine's)
RESUMABLE_CHANGES = (
    "schedule.steps",
    "eval",
    "logging",
    "output_dir",
    "guards",
    "parallel.expert_parallel_size",
    "parallel.capacity_factor",
    "schedule.micro_batch_size",
    "schedule.gradient_accumulation_steps",
    "deepspeed",
    "parallel.sharding",
    "parallel.reshard_after_forward",
)
# what a run writes once it has trained: a directory holding none of these has no output to protect
OUTPUTS = ("checkpoints", "adapter", "model", "losses.json", "results.json")


def _refuse(message: str) -> NoReturn:
    raise ValueError(f"output_dir: {message}")


def _differences(old: Any, new: Any, prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two recipe dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: List[str] = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [prefix or "(the whole recipe)"]


def _is_output(path: str) -> bool:
    return os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))


def _resumable(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE_CHANGES)


def _write_json_atomic(path: str, values: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _inputs_of(recipe_dict: Dict[str, Any]) -> List[Tuple[str, str]]:
    """What a run reads, which its output_dir may be none of, nor inside or around: the base and the data."""
    model, data = recipe_dict.get("model") or {}, recipe_dict.get("data") or {}
    found = [
        ("the base checkpoint model.from_pretrained", model.get("from_pretrained")),
        ("the data file data.path", data.get("path")),
    ]
    return [(label, where) for label, where in found if isinstance(where, str) and where.strip()]


def _run_or_leftovers(real: str) -> Optional[str]:
    """None when an existing directory may be claimed: a run of this project (its marker), or only the lock and
    probe files a claim that died before writing the marker left; else why not."""
    if os.path.exists(os.path.join(real, MARKER)):
        return None
    return None if not set(os.listdir(real)) - {LOCK, _PROBE} else f"it has no {MARKER}"


class RunDirectory:
    """A claimed output directory; ``release()`` (or leaving the ``with`` block) drops its lock.

    ``resumed`` is true when the directory already held this run (the trainer resumes there).
    """

    def __init__(self, path: str, lock_file, resumed: bool):
        self.path, self._lock_file, self.resumed = path, lock_file, resumed

    @classmethod
    def claim(
        cls, path: str, recipe_dict: Dict[str, Any], before_marking: Optional[Callable[[str], None]] = None
    ) -> "RunDirectory":
        """Check ``path`` and take it for the run of ``recipe_dict``; ValueError naming ``output_dir`` if not.
        ``before_marking(real_path)`` runs under the lock before the marker is written (its refusal leaves the
        directory as it was)."""
        real = check_output_dir(
            path,
            option="output_dir",
            protected=_inputs_of(recipe_dict),
            accept_existing=_run_or_leftovers,
            kind="a run of this project",
            fix='choose a new or empty directory, e.g. "outputs/my_run"',
        )
        marker = os.path.join(real, MARKER)
        try:
            os.makedirs(real, exist_ok=True)
        except OSError as err:
            _refuse(f"cannot create {path!r} ({err.strerror}); choose a writable location")
        lock_file = cls._lock(path, real)
        try:
            cls._check_writable(path, real)
            resumed = os.path.exists(marker)
            if resumed:
                stored = cls._read_marker(marker)
                resumed = any(_is_output(os.path.join(real, name)) for name in OUTPUTS)
                if resumed:
                    cls._check_same_run(path, marker, stored, recipe_dict)
            if before_marking is not None:
                before_marking(real)
            _write_json_atomic(marker, recipe_dict)
        except BaseException:
            lock_file.close()  # closing the file drops the flock
            raise
        return cls(real, lock_file, resumed)

    @staticmethod
    def _lock(path: str, real: str):
        try:
            lock_file = open(os.path.join(real, LOCK), "a+")
        except OSError as err:
            _refuse(f"cannot open {os.path.join(path, LOCK)} ({err.strerror}); choose a writable location")
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown"
            lock_file.close()
            _refuse(
                f"another run (pid {holder}) is using {path!r}; wait for it to finish, or choose another output_dir"
            )
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        return lock_file

    @staticmethod
    def _check_writable(path: str, real: str) -> None:
        # checked now: a run that can only fail at its final save would waste the whole training
        probe = os.path.join(real, _PROBE)
        try:
            with open(probe, "w") as f:
                f.write("probe\n")
            os.remove(probe)
        except OSError as err:
            _refuse(f"{path!r} is not writable ({err.strerror}); choose a writable location")

    @staticmethod
    def _read_marker(marker: str) -> Dict[str, Any]:
        try:
            with open(marker, encoding="utf-8") as f:
                stored = json.load(f)
        except json.JSONDecodeError as err:
            _refuse(f"{marker}, line {err.lineno}: not valid JSON ({err.msg}); repair it or choose a new directory")
        except (OSError, UnicodeDecodeError) as err:
            _refuse(
                f"{marker}: cannot read it ({getattr(err, 'strerror', None) or err}); repair it or choose a new "
                "directory"
            )
        if not isinstance(stored, dict):
            _refuse(
                f"{marker}: holds {type(stored).__name__}, not the recipe (a JSON object); repair it or choose "
                "a new directory"
            )
        return stored

    @staticmethod
    def _check_same_run(path: str, marker: str, stored: Dict[str, Any], recipe_dict: Dict[str, Any]) -> None:
        changed = [key for key in _differences(stored, recipe_dict) if not _resumable(key)]
        if changed:
            _refuse(
                f"{path!r} holds a run of another recipe: {', '.join(changed)} differ from its {MARKER}, and "
                f"resuming with another model, adapters or data is not a resume (only "
                f"{', '.join(RESUMABLE_CHANGES[:3])} may change); choose a new directory or restore those values"
            )

    def refuse_overwriting_outputs(self, latest_step: Optional[int]) -> None:
        """ValueError naming the outputs of a finished run (``adapter/`` or ``model/``, and ``losses.json``)
        when the newest usable checkpoint (``latest_step``, None: none) is older than its losses: resuming
        would train again over them."""
        finals = [name for name in ("adapter", "model") if os.path.isdir(os.path.join(self.path, name))]
        losses_path = os.path.join(self.path, "losses.json")
        if not finals or not os.path.isfile(losses_path):
            return
        try:
            with open(losses_path, encoding="utf-8") as f:
                trained = len(json.load(f))
        except (OSError, ValueError, TypeError):
            trained = None  # unreadable: its run got at least as far as it, so protect it all the same
        if latest_step is not None and trained is not None and latest_step >= trained:
            return
        held = (
            f"its newest usable checkpoint is step {latest_step}"
            if latest_step is not None
            else "none of its checkpoints can be resumed (no complete COMPLETE marker)"
        )
        shown = ", ".join(os.path.join(self.path, n) for n in finals + ["losses.json"])
        _refuse(
            f"{self.path!r} holds the outputs of a finished run ({shown}{f', {trained} steps' if trained else ''}) "
            f"but {held}, so starting it again would train over them; move them aside or choose a new "
            "output_dir"
        )

    @property
    def held(self) -> bool:
        return self._lock_file is not None

    def release(self) -> None:
        """Drop the lock (the lock file stays: removing it could let two runs lock two different files)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        self.release()
        return None


def check_resume_layout(
    recipe_dict: Dict[str, Any], latest: Optional[Tuple[int, str]], world: int, stored: Optional[Dict[str, Any]]
) -> None:
    """Refuse (ValueError naming the field) resuming checkpoint ``latest`` (``(step, path)``) on ``world``
    processes with ``recipe_dict`` when the global batch differs from the one it was written with, or when it is
    a checkpoint of an earlier version (DeepSpeed's files only) and the layout changed. ``stored``: the recipe
    the run recorded."""
    if latest is None:
        return
    from .trainable_state import META, read_trainable_meta

    step, path = latest
    schedule, parallel = recipe_dict.get("schedule") or {}, recipe_dict.get("parallel") or {}
    micro, accumulation = schedule.get("micro_batch_size"), schedule.get("gradient_accumulation_steps")
    ep = parallel.get("expert_parallel_size")
    if not os.path.exists(os.path.join(path, META)):
        with open(os.path.join(path, COMPLETE)) as f:
            written = json.load(f).get("world_size")
        old_ep = ((stored or {}).get("parallel") or {}).get("expert_parallel_size", ep)
        if (written, old_ep) != (world, ep):
            _refuse(
                f"{path} was written by an earlier version of moe_plugin on {written} processes at "
                f"parallel.expert_parallel_size {old_ep}, and holds no layout-free state; resume it on "
                f"{written} processes with parallel.expert_parallel_size {old_ep}, or start a new output_dir"
            )
        return
    layout = read_trainable_meta(path)["layout"]
    readers = world // (parallel.get("context_parallel_size") or 1)  # context-parallel ranks share rows
    if layout["global_batch"] != micro * accumulation * readers:
        _refuse(
            f"schedule.micro_batch_size x schedule.gradient_accumulation_steps x {readers} data-parallel ranks is "
            f"{micro * accumulation * readers} rows a step, but checkpoint step {step} was written with "
            f"{layout['global_batch']} ({layout['world']} processes); a resume keeps the global batch: make "
            f"micro_batch_size x gradient_accumulation_steps {layout['global_batch'] / readers:g}"
        )


def claim_for_training(
    output_dir: str,
    recipe_dict: Dict[str, Any],
    checkpoints,
    base_path: Optional[str],
    allow_changed_inputs: bool = False,
    world: int = 1,
) -> RunDirectory:
    """The trainer's claim (rank 0): ``RunDirectory.claim``, then refuse damaged checkpoints and a finished run's
    outputs that resuming would train over, then compare the inputs with those the run recorded (when there is
    a checkpoint to resume) and record them. ``checkpoints``: the run's ``CheckpointManager``."""
    current: Dict[str, Any] = {}

    def check(real: str) -> None:  # before the marker is written: a refusal changes nothing
        for problem in checkpoints.damaged():  # skipped, kept: the newest complete one resumes instead
            print(
                f"warning: {problem}, so that checkpoint changed after it was saved: it is not resumed (its "
                "files are left as they are) and the newest complete checkpoint is",
                file=sys.stderr,
                flush=True,
            )
        latest = checkpoints.latest()
        RunDirectory(real, None, True).refuse_overwriting_outputs(latest[0] if latest else None)
        marker = os.path.join(real, MARKER)
        check_resume_layout(
            recipe_dict, latest, world, RunDirectory._read_marker(marker) if os.path.isfile(marker) else None
        )
        current.update(fingerprint_inputs(recipe_dict, base_path))
        recorded = read_recorded_inputs(real) if latest else None
        if recorded is not None:
            try:
                check_inputs(recorded, current, override_flag=OVERRIDE_FLAG)
            except ValueError as err:
                if not allow_changed_inputs:
                    raise
                print(f"warning: {err} (going on: {OVERRIDE_FLAG} was given)", file=sys.stderr, flush=True)

    run_dir = RunDirectory.claim(output_dir, recipe_dict, before_marking=check)
    try:
        write_recorded_inputs(run_dir.path, current)
    except BaseException:
        run_dir.release()
        raise
    return run_dir
