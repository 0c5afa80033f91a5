"""Prepare this process's device and start and stop torch.distributed and megatron-core's process groups.

A process declares its device once: ``prepare_device("cpu")`` applies the CPU stand-ins of
``moe_plugin.parallel.cpu_compat`` (megatron-core and DeepSpeed); ``prepare_device("cuda")`` requires a usable
CUDA and selects the GPU of ``LOCAL_RANK``. Which kind a run takes when nobody names one is ``choose_device``,
the one policy (the recipe trainer's): CUDA when it works, the CPU only where no GPU is visible, so a GPU node
whose CUDA set-up is broken fails there instead of quietly training on CPU stand-ins.

The rank and world come from torchrun's ``RANK`` and ``WORLD_SIZE`` (and ``LOCAL_RANK``). The ranks meet at
``MOE_PLUGIN_DIST_INIT_METHOD`` when it is set (``moe_plugin.testing.launch`` sets a ``file://`` rendezvous
there) and otherwise at torchrun's ``MASTER_ADDR``/``MASTER_PORT``. The backend follows the device: ``gloo``
for ``"cpu"``, ``nccl`` for ``"cuda"``.
"""

from __future__ import annotations

import datetime
import glob
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from .cpu_compat import apply_cpu_patches

INIT_METHOD_ENV = "MOE_PLUGIN_DIST_INIT_METHOD"  # a torch.distributed init_method URL (file://...)
TIMEOUT_ENV = "MOE_PLUGIN_DIST_TIMEOUT_S"  # the process-group timeout in seconds
DEVICES = ("cpu", "cuda")
DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_DEFAULT_TIMEOUT_S = 300.0
_PREPARED: List[str] = []  # the device kind prepare_device() set this process up for (one at most)


def choose_device() -> torch.device:
    """CUDA when it works; the CPU only on a machine without usable GPUs.

    A machine whose GPUs are visible (``/dev/nvidia*``, no ``CUDA_VISIBLE_DEVICES`` hiding them) but where
    CUDA does not initialise is an error, not a silent CPU run on stand-ins.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", _local_rank())
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    if not hidden and glob.glob("/dev/nvidia[0-9]*"):
        raise RuntimeError(
            "this machine has NVIDIA GPUs but CUDA is not usable (torch.cuda.is_available() is "
            "False): fix the CUDA set-up, or hide the GPUs with CUDA_VISIBLE_DEVICES= for a CPU run"
        )
    return torch.device("cpu")


def _check_device(device: object) -> str:
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {DEVICES}, got {device!r}")
    return device


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    if not value.isdigit():
        raise ValueError(f"environment: LOCAL_RANK must be a non-negative integer (as torchrun sets it), got {value!r}")
    return int(value)


def prepare_device(device: str) -> torch.device:
    """Set this process up to compute on ``device`` (``"cpu"`` or ``"cuda"``); return the torch device.

    ``"cpu"``: applies ``apply_cpu_patches()`` (which refuses where CUDA is usable: hide the GPUs with
    ``CUDA_VISIBLE_DEVICES=""``). ``"cuda"``: raises RuntimeError unless ``torch.cuda.is_available()``, then
    selects GPU ``LOCAL_RANK`` (default 0). Idempotent; a process cannot switch kinds (ValueError).
    """
    _check_device(device)
    if _PREPARED and _PREPARED[0] != device:
        raise ValueError(
            f"device: this process was already prepared for {_PREPARED[0]!r}, got {device!r}; one "
            "process runs on one kind of device"
        )
    if device == "cpu":
        apply_cpu_patches()
        prepared = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "prepare_device('cuda'): CUDA is not usable here (torch.cuda.is_available() is False; torch "
                f"{torch.__version__} built for CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). A GPU run does not fall back to the CPU "
                "stand-ins: fix the driver / CUDA build of torch / visible devices, or run with device 'cpu'"
            )
        local_rank, count = _local_rank(), torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"environment: LOCAL_RANK={local_rank} but only {count} GPU(s) are visible; start "
                "at most one process per visible GPU"
            )
        torch.cuda.set_device(local_rank)
        prepared = torch.device("cuda", local_rank)
    _PREPARED[:] = [device]
    return prepared


def prepared_device() -> Optional[str]:
    """The device kind ``prepare_device`` set this process up for, or None before it was called."""
    return _PREPARED[0] if _PREPARED else None


def init_distributed(
    device: Optional[str] = None, backend: Optional[str] = None, timeout_s: Optional[float] = None
) -> int:
    """Initialise the default process group from the environment (idempotent); return this rank.

    ``device``: ``"cpu"`` or ``"cuda"``, prepared with ``prepare_device`` if that was not done yet; ``None``
    takes the device this process was prepared for (and fails if it was not).
    ``backend``: ``None`` is ``gloo`` for ``"cpu"`` and ``nccl`` for ``"cuda"``.
    ``timeout_s``: the timeout of every collective; ``None`` reads ``MOE_PLUGIN_DIST_TIMEOUT_S``, else 300 s.
    """
    if dist.is_initialized():
        return dist.get_rank()
    rendezvous = (INIT_METHOD_ENV,) if os.environ.get(INIT_METHOD_ENV) else ("MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in ("RANK", "WORLD_SIZE") + rendezvous if name not in os.environ]
    if missing:
        raise ValueError(f"environment: {', '.join(missing)} must be set (as torchrun does) to start torch.distributed")
    if device is None:
        device = prepared_device()
        if device is None:
            raise ValueError(
                "device: not given and prepare_device() was not called in this process; pass device='cpu' or 'cuda'"
            )
    _check_device(device)
    if backend is None:
        backend = DEFAULT_BACKENDS[device]
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"backend: 'nccl' runs on GPUs only, but device is {device!r}; use 'gloo' on CPU")
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
    prepare_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=os.environ.get(INIT_METHOD_ENV) or "env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank()


def initialize_megatron(
    expert_model_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    seed: Optional[int] = 1234,
    backend: Optional[str] = None,
    device: Optional[str] = None,
) -> None:
    """Start torch.distributed (if needed) and megatron-core's parallel state with the given EP/TP/CP sizes.

    The process must be prepared for its device (``prepare_device``, or ``device`` here, which prepares it);
    on CPU that is what applies megatron-core's CPU stand-ins. ``backend`` goes to ``init_distributed``.
    The world is split as megatron does: tensor-parallel groups of ``tensor_model_parallel_size``,
    expert-parallel groups of ``expert_model_parallel_size`` (the expert-data-parallel group is the rest).
    ``seed``: seeds torch's default (CPU) generator and megatron's RNG tracker
    (``model_parallel_cuda_manual_seed``), as megatron's own training setup does: everything initialised
    from the default generator afterwards (dense weights, plain torch modules) is the same on every rank,
    on GPU as on CPU, and expert initialisation differs per EP rank. ``None`` leaves both alone.
    """
    for name, value in (
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if device is not None:
        prepare_device(device)
    elif prepared_device() is None:
        raise RuntimeError(
            "initialize_megatron: the device of this process is not prepared; call "
            "prepare_device('cpu') or prepare_device('cuda') first (run_distributed's ranks are "
            "prepared), or pass device="
        )
    init_distributed(prepared_device(), backend)
    world = dist.get_world_size()
    if world % (expert_model_parallel_size * tensor_model_parallel_size) != 0:
        raise ValueError(
            f"expert_model_parallel_size: expert x tensor parallel size "
            f"({expert_model_parallel_size} x {tensor_model_parallel_size}) must divide the "
            f"world size {world}"
        )
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if world % (context_parallel_size * tensor_model_parallel_size) != 0:
        raise ValueError(
            f"context_parallel_size: context x tensor parallel size ({context_parallel_size} x "
            f"{tensor_model_parallel_size}) must divide the world size {world}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )
    if seed is not None:
        # upstream seeds only the CUDA generator; on CPU the stand-in reseeds this same generator anyway
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state (if megatron was used), DeepSpeed's expert groups (if DeepSpeed was
    used) and the default process group: a group started later in this process finds nothing of this one."""
    if "megatron.core.parallel_state" in sys.modules:
        parallel_state = sys.modules["megatron.core.parallel_state"]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if "deepspeed.utils.groups" in sys.modules:
        from ..compat.deepspeed import forget_groups

        forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
