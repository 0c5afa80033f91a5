"""The one rule for a directory a command writes, so that no output path can destroy data (docs/exports.md).

``check_output_dir`` resolves symlinks first (a link to ``$HOME`` is ``$HOME``), then refuses the filesystem
root, the current directory and its parents, the home directory and its parents, an existing non-directory,
every protected path the command reads (its run directory, the base checkpoint, ...) together with anything
inside or containing one, and an existing non-empty directory unless the caller recognises it as an earlier
output of the same kind (which it may then replace as a whole). No torch, no distributed code: every command
that writes can use it.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, NoReturn, Optional, Sequence, Tuple

__all__ = ["check_output_dir", "real_path", "is_same_or_inside"]

Protected = Sequence[Tuple[str, str]]  # (what it is, e.g. "the run directory"; its path)


def real_path(path: str) -> str:
    """``path`` with ``~`` expanded and every symlink resolved: what a write would really touch."""
    return os.path.realpath(os.path.expanduser(path))


def is_same_or_inside(path: str, of: str) -> bool:
    """True when ``path`` is ``of`` or lies below it (both already real paths)."""
    return path == of or path.startswith(of.rstrip(os.sep) + os.sep)


def _refuse(option: str, given: str, what: str, real: str, fix: str) -> NoReturn:
    raise ValueError(f"{option}: {given!r} is {what} ({real}); {fix}")


def _shown(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def check_output_dir(
    path: str,
    *,
    option: str,
    protected: Protected = (),
    accept_existing: Optional[Callable[[str], Optional[str]]] = None,
    kind: str = "an earlier output of this command",
    fix: str = 'give a new or empty directory, e.g. "exports/my_export"',
) -> str:
    """Check that writing ``path`` (replacing it as a whole) can lose nothing; return its real path.

    option: how the user named the path (``OUT``, ``--out``, ``output_dir``), the message's first word.
    protected: ``(label, path)`` of everything the command reads; ``path`` may be none of them, nor inside or
    contain one. accept_existing: called with the real path of an existing non-empty directory; returns None
    when it is ``kind`` (an earlier output that may be replaced), else a short reason why not (it is refused).
    fix: the advice that ends every message. Raises ValueError, one line naming ``option``.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{option}: is empty ({path!r}); {fix}")
    real = real_path(path)
    if real == real_path(os.sep):
        _refuse(option, path, "the filesystem root", real, fix)
    cwd, home = real_path(os.getcwd()), real_path("~")
    if is_same_or_inside(cwd, real):
        _refuse(option, path, "the current directory or one of its parents", real, fix)
    if is_same_or_inside(home, real):
        _refuse(option, path, "the home directory or one of its parents", real, fix)
    resolved = [(label, real_path(where)) for label, where in protected]
    for label, where_real in resolved:  # callers list the most specific first: "the run's adapter", then the run
        if real == where_real:
            _refuse(option, path, f"{label}, which this command reads", real, fix)
        if is_same_or_inside(real, where_real):
            _refuse(option, path, f"inside {label} {where_real}, which this command reads", real, fix)
    for label, where_real in reversed(resolved):  # so a parent is named by the widest thing it holds
        if is_same_or_inside(where_real, real):
            _refuse(option, path, f"a parent of {label} {where_real}, which this command reads", real, fix)
    if os.path.lexists(real) and not os.path.isdir(real):
        _refuse(option, path, "an existing file, not a directory", real, fix)
    if os.path.isdir(real):
        entries = os.listdir(real)
        if entries:
            reason = "nothing recognises it" if accept_existing is None else accept_existing(real)
            if reason is not None:
                _refuse(
                    option, path, f"a non-empty directory ({_shown(entries)}) that is not {kind}: {reason}", real, fix
                )
    return real
