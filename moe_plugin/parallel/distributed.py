"""Start and stop torch.distributed and megatron-core's process groups.

The rank and world come from torchrun's ``RANK`` and ``WORLD_SIZE`` (and ``LOCAL_RANK``). The ranks meet at
``MOE_PLUGIN_DIST_INIT_METHOD`` when it is set (``moe_plugin.parallel.launch`` sets a ``file://`` rendezvous
there) and otherwise at torchrun's ``MASTER_ADDR``/``MASTER_PORT``. The backend is ``nccl`` when CUDA is
present and ``gloo`` otherwise; without CUDA the megatron-core CPU stand-ins
(``moe_plugin.parallel.cpu_compat``) are applied before any megatron module is built.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .cpu_compat import apply_cpu_patches

INIT_METHOD_ENV = "MOE_PLUGIN_DIST_INIT_METHOD"  # a torch.distributed init_method URL (file://...)
TIMEOUT_ENV = "MOE_PLUGIN_DIST_TIMEOUT_S"  # the process-group timeout in seconds
_DEFAULT_TIMEOUT_S = 300.0


def init_distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> int:
    """Initialise the default process group from the environment (idempotent); return this rank.

    ``backend``: ``None`` picks ``nccl`` with CUDA and ``gloo`` without.
    ``timeout_s``: the timeout of every collective; ``None`` reads ``MOE_PLUGIN_DIST_TIMEOUT_S``, else 300 s.
    """
    if dist.is_initialized():
        return dist.get_rank()
    rendezvous = (INIT_METHOD_ENV,) if os.environ.get(INIT_METHOD_ENV) else ("MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in ("RANK", "WORLD_SIZE") + rendezvous if name not in os.environ]
    if missing:
        raise ValueError(f"environment: {', '.join(missing)} must be set (as torchrun does) to start "
                         "torch.distributed")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method=os.environ.get(INIT_METHOD_ENV) or "env://",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank()


def initialize_megatron(expert_model_parallel_size: int = 1, tensor_model_parallel_size: int = 1,
                        seed: Optional[int] = 1234, backend: Optional[str] = None) -> None:
    """Start torch.distributed (if needed) and megatron-core's parallel state with the given EP/TP sizes.

    The world is split as megatron does: tensor-parallel groups of ``tensor_model_parallel_size``,
    expert-parallel groups of ``expert_model_parallel_size`` (the expert-data-parallel group is the rest).
    ``seed``: seeds torch's default (CPU) generator and megatron's RNG tracker
    (``model_parallel_cuda_manual_seed``), as megatron's own training setup does: everything initialised
    from the default generator afterwards (dense weights, plain torch modules) is the same on every rank,
    on GPU as on CPU, and expert initialisation differs per EP rank. ``None`` leaves both alone.
    """
    for name, value in (("expert_model_parallel_size", expert_model_parallel_size),
                        ("tensor_model_parallel_size", tensor_model_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    apply_cpu_patches()
    init_distributed(backend)
    world = dist.get_world_size()
    if world % (expert_model_parallel_size * tensor_model_parallel_size) != 0:
        raise ValueError(f"expert_model_parallel_size: expert x tensor parallel size "
                         f"({expert_model_parallel_size} x {tensor_model_parallel_size}) must divide the "
                         f"world size {world}")
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                             expert_model_parallel_size=expert_model_parallel_size)
    if seed is not None:
        # upstream seeds only the CUDA generator; on CPU the stand-in reseeds this same generator anyway
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state (if megatron was used) and the default process group."""
    if "megatron.core.parallel_state" in sys.modules:
        parallel_state = sys.modules["megatron.core.parallel_state"]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
