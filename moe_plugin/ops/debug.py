"""The one switch for value checks that read the device: ``MOE_PLUGIN_DEBUG_CHECKS=1``.

A value check (ids in range, say) needs the values on the host, which on a GPU waits for the stream; the hot
path skips them unless this is set (issue 24: value checks only in debug mode). Shape and dtype checks read
no values and always run. Read on every call, so a test or a run can set it at any time.
"""

from __future__ import annotations

import os

ENV = "MOE_PLUGIN_DEBUG_CHECKS"


def debug_checks() -> bool:
    """Whether ``MOE_PLUGIN_DEBUG_CHECKS`` is set to ``1`` (or ``true`` / ``yes``, any case)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")
