"""megatron-core's collectives under torch's current names.

megatron-core 0.16 binds ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor`` to module
aliases at import (``tensor_parallel.mappings``, ``tensor_parallel.layers``, ``utils``). torch 2.13 deprecates both as plain forwards to
``all_gather_single``/``reduce_scatter_single``, so the token dispatcher's gather printed a FutureWarning on every
rank at the first step, into the progress bar. ``use_current_collectives()`` rebinds those aliases; DeepSpeed's
own are rebound by ``moe_plugin.compat.deepspeed.use_current_collectives``.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

__all__ = ["use_current_collectives"]

# module -> {alias: (torch's deprecated function it holds, torch's replacement)}
_BOTH = {"dist_all_gather_func": ("all_gather_into_tensor", "all_gather_single"),
         "dist_reduce_scatter_func": ("reduce_scatter_tensor", "reduce_scatter_single")}
_ALIASES = {
    "megatron.core.tensor_parallel.mappings": _BOTH,
    "megatron.core.tensor_parallel.layers": _BOTH,
    "megatron.core.utils": {"dist_all_gather_func": ("all_gather_into_tensor", "all_gather_single")},
}


def use_current_collectives() -> None:
    """Rebind megatron-core's aliases that hold a deprecated torch collective to its replacement (same
    arguments, same result). An alias that holds anything else, or a torch without the new name, is left."""
    for module_name, aliases in _ALIASES.items():
        module = importlib.import_module(module_name)
        for alias, (old, new) in aliases.items():
            current = getattr(dist, new, None)
            if current is not None and getattr(module, alias, None) is getattr(dist, old, None):
                setattr(module, alias, current)
