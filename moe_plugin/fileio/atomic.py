"""Writing checkpoints all-or-nothing: a failed, interrupted or killed save never harms the last good one.

``atomic_directory(path)`` lets the caller write a new version of a directory beside it and then puts it in
place in one step, so that a reader opening ``path/...`` finds the old or the new complete directory at every
moment, also when the saving process is killed (SIGKILL) anywhere in between:

* On Linux the new directory and ``path`` are swapped with one ``renameat2(RENAME_EXCHANGE)`` call; the old
  directory then sits under the temporary name and is removed.
* Where the kernel or the file system cannot swap (other systems; file systems that refuse the flag), ``path``
  is renamed aside to ``.<name>.replaced-<token>`` and the new directory renamed onto ``path``. A kill between
  these two renames leaves no ``path`` until ``resolve_atomic_directory(path)`` (which the next save calls
  first, and which readers may call) renames the old directory back.

Leftovers are named ``.<name>.saving-<token>`` (a save under way, or the old directory after a swap) and
``.<name>.replaced-<token>``, with ``<token>`` 16 hex digits, and nothing else beside ``path`` is touched. A
writer holds an ``flock`` on its ``.saving-`` directory until the swap, so that cleaning up removes only what
a dead writer left (the kernel drops the lock of a killed process) and never a concurrent save under way.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
from typing import Any, Iterator, List, Optional, Tuple

_SAVING, _REPLACED = "saving", "replaced"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_renameat2 = None  # the C function, looked up once; False where libc has none


def _exchange(a: str, b: str) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step; False where this system or file system cannot."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _target(path: str | os.PathLike) -> Tuple[str, str, str]:
    """``(path, parent, name)`` with symlinks resolved: a link to a directory elsewhere (a scratch file
    system, say) keeps pointing there and the directory it names is the one replaced."""
    target = os.path.realpath(os.fspath(path))
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ValueError(
            f"path: {target} exists and is not a directory; atomic_directory replaces a directory "
            "as a whole and will not delete a file: move the file away or choose another path"
        )
    parent, name = os.path.split(target)
    return target, parent, name


def _leftovers(parent: str, name: str) -> List[Tuple[str, str, str]]:
    """``(kind, token, path)`` of every entry in ``parent`` named like a leftover of saving ``name``."""
    pattern = re.compile(rf"\.{re.escape(name)}\.({_SAVING}|{_REPLACED})-([0-9a-f]{{16}})")
    found = []
    for entry in os.listdir(parent):
        match = pattern.fullmatch(entry)
        if match:
            found.append((match.group(1), match.group(2), os.path.join(parent, entry)))
    return found


def _try_lock(directory: str) -> Optional[int]:
    """An fd holding an exclusive flock on ``directory``, or None when another process holds it or it is
    not a directory of its own (a symlink, a file, gone)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def resolve_atomic_directory(path: str | os.PathLike) -> str:
    """Finish what an interrupted save of ``path`` left: restore ``path`` from ``.<name>.replaced-*`` when a
    save was killed between its two renames, and remove the leftovers of dead writers. Returns ``path``
    (symlinks resolved). Safe to call at any time, by readers too; ``atomic_directory`` calls it first."""
    target, parent, name = _target(path)
    if not os.path.isdir(parent):
        return target
    leftovers = _leftovers(parent, name)
    live = set()
    for kind, token, entry in leftovers:
        if kind == _SAVING:
            fd = _try_lock(entry)
            if fd is None and os.path.isdir(entry) and not os.path.islink(entry):
                live.add(token)  # a writer is saving, or between its two renames: leave its work alone
            elif fd is not None:
                os.close(fd)
    if not os.path.lexists(target):
        # a killed swap: the old complete directory is the one renamed aside (the latest, should there be more)
        aside = [
            (os.lstat(e).st_ctime, e)
            for kind, token, e in leftovers
            if kind == _REPLACED and token not in live and os.path.isdir(e) and not os.path.islink(e)
        ]
        if aside:
            os.rename(max(aside)[1], target)
    for _kind, token, entry in leftovers:
        if token in live or not os.path.lexists(entry):
            continue
        fd = _try_lock(entry)
        if fd is None:
            continue  # not a directory we made, or just taken by a new writer
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
    return target


def _new_saving_directory(parent: str, name: str) -> Tuple[str, int]:
    """Create ``.<name>.saving-<token>`` in ``parent`` and lock it; returns its path and the lock's fd."""
    for _ in range(100):
        staging = os.path.join(parent, f".{name}.{_SAVING}-{secrets.token_hex(8)}")
        os.mkdir(staging)
        fd = _try_lock(staging)
        # a concurrent clean-up may take the new directory for a dead writer's before it is locked: then the
        # lock fails, or is held on a directory no longer there
        if fd is not None:
            try:
                if os.path.samestat(os.fstat(fd), os.lstat(staging)):
                    return staging, fd
            except FileNotFoundError:
                pass
            os.close(fd)
    raise OSError(f"could not create and lock a staging directory for {name} in {parent}")


def _fsync_tree(root: str) -> None:
    """Flush every file and directory under ``root`` to disk, so that what a rename publishes survives a
    power cut too, not only the death of the process."""
    for directory, _, files in os.walk(root):
        for file in files:
            path = os.path.join(directory, file)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(directory)


def fsync_path(path: str) -> None:
    """Flush a file's or a directory's entry to disk (a directory: its renames and new names)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(staging: str, target: str, parent: str, name: str) -> Optional[str]:
    """Put ``staging`` at ``target`` in one step where the system can; returns where the old directory went."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return None
    if _exchange(staging, target):
        return staging
    # no atomic swap here: a kill between these two renames leaves ``target`` missing and the old directory
    # under ``.replaced-``, which resolve_atomic_directory renames back
    token = os.path.basename(staging).rsplit("-", 1)[1]
    aside = os.path.join(parent, f".{name}.{_REPLACED}-{token}")
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    return aside


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, fsync: bool = True) -> Iterator[str]:
    """Yield a fresh directory beside ``path``; on success it replaces ``path`` as a whole.

    If the body raises, the new directory is removed and ``path`` is untouched. The old directory is removed
    only after the new one is in place, so no stale file of an earlier save (another shard count, say)
    survives next to the new ones. A kill at any moment leaves the old or the new complete directory (see
    the module docstring for the one exception, on systems without an atomic swap); the next save removes
    the leftovers. ``fsync``: flush the new files to disk before publishing them.

    ``path`` may be missing or a directory (it need not be one this function made: it is replaced as a
    whole, as before); a symlink is followed. ValueError when it is a file or another non-directory.
    """
    target = resolve_atomic_directory(path)  # also refuses a non-directory, before the body does any work
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    staging, lock = _new_saving_directory(parent, name)
    try:
        try:
            yield staging
            if fsync:
                _fsync_tree(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            retired = _swap_in(staging, target, parent, name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        os.close(lock)
    if fsync:
        fsync_path(parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


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


def read_json(path: str | os.PathLike, fix: str) -> Any:
    """The JSON value in ``path``; a one-line ValueError naming the file (and the line) when it cannot be read or
    is not JSON, ending with ``fix``. Callers check the value's shape themselves."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}); {fix}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it ({getattr(err, 'strerror', None) or err}); {fix}") from None
