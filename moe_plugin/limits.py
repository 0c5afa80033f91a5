"""The sizes ``moe-plugin plan`` and a recipe accept: each flag and recipe size has a largest value, named when
refused. Torch-free and in the bottom tier, so the plan command checks its flags before anything heavy loads and
the recipe (``recipe/schema.py``) checks its sizes against the same numbers: whatever trains can be planned."""

from __future__ import annotations

import math

from .config import require

__all__ = ["LIMITS", "check_limit", "parse_bytes"]

# The largest sizes plan accepts, each far past what a run needs, so that no real plan is refused while every
# number stays exact and a plan ends in seconds (an absurd value used to run out of memory or print "fits"):
LIMITS = {
    "seq_len": 1 << 24,  # 16M tokens a row: 16 x the 1M-token context plan reports
    "micro_batch": 1 << 16,  # rows per micro-batch per rank
    "grad_accum": 1 << 16,  # micro-batches per step
    "devices": 1 << 16,  # 65536 accelerators: past today's largest training jobs
    "device_memory": 100e12,  # 100 TB: 700 x an H200's 141 GB, and past any one host's memory
    "images": 1 << 12,  # pictures per micro-batch; their patch layout is computed for real on the CPU
    "image_size": 1 << 13,  # 8192 px a side: 87k image tokens a picture (14 px patches, 2 x 2 merge)
    "capacity": 128.0,  # past num_experts / top_k (56 for K3) every token fits its experts; more changes nothing
    "num_documents": 1_000_000,  # generated (arithmetic) documents the plan packs
}


def check_limit(value, name: str, field_name: str, least: float = 1) -> None:
    """Refuse ``value`` (for ``LIMITS[name]``, reported as ``field_name``) unless finite and in
    [``least``, the limit]."""
    largest = LIMITS[name]
    shown = (
        f"{largest / 1e12:g}TB"
        if name == "device_memory"
        else f"{largest:,}"
        if isinstance(largest, int)
        else f"{largest:g}"
    )
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and math.isfinite(value))
    require(
        ok and least <= value <= largest,
        field_name,
        f"must be from {least:g} to {shown} (the largest the planner accepts), got {value!r}; give a value "
        "in that range",
    )


def parse_bytes(text: str) -> float:
    """``"141GB"``, ``"80GiB"``, ``"512MiB"``, a plain number of bytes -> bytes; ValueError naming the value."""
    units = {
        "": 1,
        "B": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    require(
        not math.isnan(value) and unit in units,
        "--device-memory",
        f"{text!r} is not a memory size; write e.g. 141GB, 80GiB or 512MiB",
    )
    size, largest = value * units[unit], LIMITS["device_memory"]
    require(
        0 < size <= largest,
        "--device-memory",
        f"{text!r} is outside the sizes the planner accepts (above 0, "
        f"at most {largest / 1e12:g}TB); give a device's memory, e.g. 141GB",
    )
    return size
