"""Every reach into an upstream's internals, one module per upstream, each pinned to the tested version.

``torch``, ``deepspeed``, ``megatron`` (megatron-core), ``peft``, ``transformers`` and ``fla``
(flash-linear-attention) each hold the version setup.cfg pins, small named functions wrapping each private
function, attribute or class trick moe_plugin relies on, and a ``check()`` that every upstream name they use
exists (one-line RuntimeError naming the upstream name, the installed version and the pin). ``check_all`` runs
the checks once per process where the product starts: the recipe trainer (``training.loop.Trainer``), its
megatron backend, and the Hugging Face Trainer wrapper (``hf_trainer.MoETrainer``). docs/compat.md lists each
reach and why.

Bottom tier: this package imports upstreams only, lazily, and no other moe_plugin package.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Set

__all__ = ["UPSTREAMS", "check_all"]

UPSTREAMS = ("torch", "deepspeed", "megatron", "peft", "transformers", "fla")
_PASSED: Set[str] = set()


def check_all(upstreams: Iterable[str] = UPSTREAMS) -> None:
    """``check()`` of each named compat module, once per process (a passed check is not repeated)."""
    for name in upstreams:
        if name not in UPSTREAMS:
            raise ValueError(f"upstreams: unknown compat module {name!r}; expected some of {list(UPSTREAMS)}")
        if name not in _PASSED:
            importlib.import_module(f"{__name__}.{name}").check()
            _PASSED.add(name)
