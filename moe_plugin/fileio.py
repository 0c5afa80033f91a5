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
