"""What every compat module shares: the installed version of an upstream and the one-line missing-name error.

Kept apart from the per-upstream modules so that each of them names its own upstream, pin and reaches, and
none imports another upstream.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any, Iterable

__all__ = ["installed_version", "missing", "resolve", "require_in_source"]


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (pip's name, e.g. ``megatron-core``), or ``not installed``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing(compat: str, distribution: str, pinned: str, name: str, detail: str = "is missing") -> RuntimeError:
    """The one-line error of a compat check: which upstream name, which installed version, which pin."""
    return RuntimeError(
        f"moe_plugin.compat.{compat}: {name} {detail} in {distribution} "
        f"{installed_version(distribution)} (tested with {pinned}); install {distribution}=={pinned} "
        "(setup.cfg pins it; docs/compat.md lists what moe_plugin reaches into)"
    )


def resolve(compat: str, distribution: str, pinned: str, module: str, attr_path: str = "") -> Any:
    """``module.attr_path`` of the upstream, or ``missing(...)`` naming the first part that is not there."""
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise missing(compat, distribution, pinned, module, f"cannot be imported ({err})") from None
    walked = module
    for part in attr_path.split(".") if attr_path else ():
        walked += f".{part}"
        if not hasattr(obj, part):
            raise missing(compat, distribution, pinned, walked)
        obj = getattr(obj, part)
    return obj


def require_in_source(
    compat: str, distribution: str, pinned: str, owner: Any, owner_name: str, names: Iterable[str], what: str
) -> None:
    """Check that ``owner``'s source still mentions each of ``names`` (attributes upstream sets or reads on
    objects at run time, which no ``hasattr`` on a module can see). Source that cannot be read (a compiled
    install) is not checked."""
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return
    for name in names:
        if name not in source:
            raise missing(compat, distribution, pinned, f"{what} {name!r}", f"is no longer used by {owner_name}")
