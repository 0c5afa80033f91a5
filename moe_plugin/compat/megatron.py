"""Every reach into megatron-core's internals (tested with megatron-core 0.16.1, the pin of setup.cfg).

* ``MoELayer.__init__`` registers the router it builds as the submodule ``router``; ``LatentMoELayer`` keeps it
  under the name the checkpoints and LoRA targets use, ``gate`` (``pop_router``).
* ``GPTModel`` builds its decoder as a ``TransformerBlock`` and ``build_gpt_model`` returns a ``GPTModel``; the
  project turns them into its subclasses in place (``adopt_subclass``: ``AttnResTransformerBlock``,
  ``MultimodalGPTModel``), which add methods and modules but no state of the base class's own.
* megatron-core 0.16 binds ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor`` to module
  aliases at import (``tensor_parallel.mappings``, ``tensor_parallel.layers``, ``utils``). torch 2.13 deprecates
  both as plain forwards to ``all_gather_single``/``reduce_scatter_single``, so the token dispatcher's gather
  printed a FutureWarning on every rank at the first step, into the progress bar. ``use_current_collectives()``
  rebinds those aliases; DeepSpeed's own are rebound by ``moe_plugin.compat.deepspeed.use_current_collectives``.

``check()`` verifies each of those names once at start-up (the megatron backend's ``setup_parallel``). The CPU
stand-ins of ``moe_plugin.parallel.cpu_compat`` check their own megatron-core targets when a CPU run applies
them, against ``TESTED_MEGATRON``.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

from ._upstream import missing, require_in_source, resolve

__all__ = ["TESTED_MEGATRON", "check", "pop_router", "adopt_subclass", "use_current_collectives"]

TESTED_MEGATRON = "0.16.1"
_DIST = "megatron-core"

# module -> {alias: (torch's deprecated function it holds, torch's replacement)}
_BOTH = {
    "dist_all_gather_func": ("all_gather_into_tensor", "all_gather_single"),
    "dist_reduce_scatter_func": ("reduce_scatter_tensor", "reduce_scatter_single"),
}
_ALIASES = {
    "megatron.core.tensor_parallel.mappings": _BOTH,
    "megatron.core.tensor_parallel.layers": _BOTH,
    "megatron.core.utils": {"dist_all_gather_func": ("all_gather_into_tensor", "all_gather_single")},
}
_MOE_LAYER = ("megatron.core.transformer.moe.moe_layer", "MoELayer")
_BLOCK = ("megatron.core.transformer.transformer_block", "TransformerBlock")
_GPT = ("megatron.core.models.gpt", "GPTModel")


def _resolve(module: str, attr: str = ""):
    return resolve("megatron", _DIST, TESTED_MEGATRON, module, attr)


def use_current_collectives() -> None:
    """Rebind megatron-core's aliases that hold a deprecated torch collective to its replacement (same
    arguments, same result). An alias that holds anything else, or a torch without the new name, is left."""
    for module_name, aliases in _ALIASES.items():
        module = importlib.import_module(module_name)
        for alias, (old, new) in aliases.items():
            current = getattr(dist, new, None)
            if current is not None and getattr(module, alias, None) is getattr(dist, old, None):
                setattr(module, alias, current)


def pop_router(layer):
    """Remove and return the router ``MoELayer.__init__`` registered as the submodule ``router`` of ``layer``
    (RuntimeError naming megatron-core's version when it registered none)."""
    router = layer._modules.pop("router", None)
    if router is None:
        raise missing(
            "megatron", _DIST, TESTED_MEGATRON, f"{'.'.join(_MOE_LAYER)}'s submodule 'router'", "was not registered"
        )
    return router


def adopt_subclass(obj, subclass: type):
    """Turn ``obj`` into ``subclass`` in place (``obj.__class__ = subclass``) and return it. Only for a subclass
    made directly on ``type(obj)`` that adds methods and modules but no ``__init__`` state of its own: anything
    else would leave the object half-built, so that is a RuntimeError naming both classes."""
    if type(obj) not in subclass.__bases__:
        bases = [b.__name__ for b in subclass.__bases__]
        raise RuntimeError(
            f"moe_plugin.compat.megatron: {subclass.__name__} extends {bases}, but megatron-core built "
            f"a {type(obj).__module__}.{type(obj).__name__}; the in-place class change needs "
            f"megatron-core {TESTED_MEGATRON}'s class (docs/compat.md)"
        )
    obj.__class__ = subclass
    return obj


def check() -> None:
    """Every megatron-core name this module uses exists in the installed megatron-core (RuntimeError naming the
    first that does not, the installed version and ``TESTED_MEGATRON``)."""
    moe_layer = _resolve(*_MOE_LAYER)
    require_in_source(
        "megatron",
        _DIST,
        TESTED_MEGATRON,
        moe_layer.__init__,
        f"{'.'.join(_MOE_LAYER)}.__init__",
        ("self.router = submodules.router(",),
        "the router submodule assignment",
    )
    _resolve(*_BLOCK)
    gpt = _resolve(*_GPT)
    require_in_source(
        "megatron",
        _DIST,
        TESTED_MEGATRON,
        gpt.__init__,
        f"{'.'.join(_GPT)}.__init__",
        ("self.decoder = TransformerBlock(",),
        "the decoder construction",
    )
    for module_name, aliases in _ALIASES.items():
        for alias in aliases:
            _resolve(module_name, alias)
