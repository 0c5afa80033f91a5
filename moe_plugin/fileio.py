"""Writing checkpoints all-or-nothing: a failed or interrupted save never harms the last good one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[str]:
    """Yield a fresh temporary directory beside ``path``; on success it replaces ``path`` as a whole.

    If the body raises, the temporary directory is removed and ``path`` is untouched. On success the old
    directory is first renamed aside and removed only after the new one is in place, so no stale file of
    an earlier save (another shard count, say) survives next to the new ones.
    """
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.saving-", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint directory is an ordinary one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.lexists(path):
        old = f"{tmp}.previous"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename, so a crash leaves the old file whole."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_weight_map(path: str | os.PathLike) -> dict:
    """``{tensor name: shard file path}`` of a checkpoint directory: ``model.safetensors.index.json`` with its
    shards, or a single ``model.safetensors``. ValueError (naming ``path``) if neither is there or the index
    lists shard files that are missing."""
    from safetensors import safe_open

    path = os.fspath(path)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
        absent = sorted({file for file in weight_map.values() if not os.path.isfile(file)})
        if absent:
            raise ValueError(f"path: {SAFETENSORS_INDEX} lists shard files that are not in {path}: "
                             f"{[os.path.basename(f) for f in absent][:10]}")
        return weight_map
    single = os.path.join(path, SAFETENSORS_SINGLE)
    if not os.path.isfile(single):
        raise ValueError(f"path: {path} holds neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}
