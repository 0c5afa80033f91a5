"""Every CPU adaptation megatron-core and DeepSpeed need, in one place, applied explicitly by a CPU run.

megatron-core assumes a GPU in a handful of calls on its MoE path (streams and events in the all-to-all
dispatcher, ``torch.cuda.current_device()`` as an allocation device, the CUDA RNG tracker). On a machine
without CUDA each of them raises, although the math around them is plain torch and runs on CPU tensors
with the ``gloo`` backend. DeepSpeed runs on CPU, but JIT-builds a C++ shared-memory all-reduce on its first
distributed start. ``apply_cpu_patches()`` gives each such call a CPU stand-in by replacing module attributes
of megatron-core and DeepSpeed (never torch itself, so nothing outside them sees a change).

Two kinds of patch:

* *CUDA namespace* patches replace the ``torch`` global of one megatron-core module by a view of torch
  whose ``torch.cuda`` answers ``current_device()`` with the CPU device and hands out do-nothing streams
  and events (``moe_plugin.parallel.cpu_standins``). This keeps upstream functions intact instead of copying
  them just to change one device argument.
* *Function* patches swap one upstream function or global for a CPU version.

Explicit and strict: the caller decides that a run is a CPU run and calls ``apply_cpu_patches()``
(``moe_plugin.parallel.distributed.prepare_device("cpu")`` does, and so does every rank of
``moe_plugin.testing.launch.run_distributed(backend="gloo")``). It refuses to run where CUDA is usable, since
the stand-ins would silently replace the GPU paths: a CPU run on a machine with GPUs hides them first
(``CUDA_VISIBLE_DEVICES=""``). Every patch is applied or the call raises ``RuntimeError`` naming the patch and
the upstream attribute that is missing; nothing is skipped, because a half-patched megatron-core fails later
in places far from the cause.

Written against megatron-core 0.16.1 and DeepSpeed 0.19.8 (Python 3.11, torch 2.13 CPU); docs/cpu.md explains
each patch. When a version moves and a target disappears, re-check the upstream call it replaced. The pins
and installed versions in the messages come from ``moe_plugin.compat`` (``TESTED_MEGATRON``,
``TESTED_DEEPSPEED``), the one place each upstream's tested version is named (docs/compat.md); the patches
stay here, applied only by a CPU run, because they are stand-ins for GPU calls rather than reaches the
product makes on every machine.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..compat._upstream import installed_version
from ..compat.deepspeed import TESTED_DEEPSPEED
from ..compat.megatron import TESTED_MEGATRON
from .cpu_standins import TORCH_ON_CPU

__all__ = ["apply_cpu_patches", "remove_cpu_patches", "cpu_patches_applied", "CPU_PATCH_NAMES", "CPU_DEVICE_MODULES"]

# --------------------------------------------------------------------------------------------------
# Bookkeeping: every replaced attribute is recorded so that remove_cpu_patches() can restore it.

_ORIGINALS: List[Tuple[Any, str, Any]] = []
_APPLIED: List[str] = []
_ABSENT = object()  # recorded original of an attribute that did not exist: removal deletes it
_FILTER_MARK = "<log filter>"  # recorded "attribute" of a logging filter: removal detaches it
_DISTRIBUTIONS = {"megatron": "megatron-core", "deepspeed": "deepspeed"}


def _installed(module_name: str) -> str:
    dist_name = _DISTRIBUTIONS.get(module_name.split(".")[0], module_name.split(".")[0])
    return f"{dist_name} {installed_version(dist_name)}"


def _target(patch: str, module_name: str, attr_path: str = "") -> Any:
    """The upstream object ``patch`` works on: the module, or ``module_name.attr_path`` within it.

    Raises RuntimeError naming the patch and the missing module or attribute."""
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeError(
            f"CPU patch {patch!r}: cannot import {module_name} with the installed "
            f"{_installed(module_name)} ({e}); install the tested version (docs/cpu.md)"
        ) from e
    walked = module_name
    for part in attr_path.split(".") if attr_path else ():
        walked += f".{part}"
        if not hasattr(obj, part):
            raise RuntimeError(
                f"CPU patch {patch!r}: {walked} does not exist in the installed {_installed(module_name)}. The "
                f"patch was written for megatron-core {TESTED_MEGATRON} / DeepSpeed {TESTED_DEEPSPEED}; check what "
                "replaced that upstream call (docs/cpu.md) and update moe_plugin.parallel.cpu_compat, or install "
                "those versions"
            )
        obj = getattr(obj, part)
    return obj


def _replace(owner: Any, attr: str, value: Any) -> None:
    _ORIGINALS.append((owner, attr, getattr(owner, attr, _ABSENT)))
    setattr(owner, attr, value)


def _record(owner: Any, attr: str) -> None:
    """Remember ``owner.attr`` without changing it, for an attribute that upstream fills in later."""
    _ORIGINALS.append((owner, attr, getattr(owner, attr)))


# --------------------------------------------------------------------------------------------------
# CUDA namespace patches, one per megatron-core module.

# module -> the upstream calls in it that the CPU torch.cuda stands in for
CPU_DEVICE_MODULES: Dict[str, str] = {
    "megatron.core.transformer.moe.token_dispatcher": (
        "torch.cuda.Stream() in MoEAlltoAllTokenDispatcher.__init__; torch.cuda.current_stream / "
        "torch.cuda.stream / Stream.record_event in MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"
    ),
    "megatron.core.transformer.moe.router": (
        "torch.cuda.current_device() in Router.gating (moves the gate weight) and in TopKRouter.__init__ "
        "(expert-bias and global-aux-loss buffers)"
    ),
    "megatron.core.transformer.moe.shared_experts": (
        "torch.cuda.Stream / current_stream / stream in SharedExpertMLP (moe_shared_expert_overlap)"
    ),
    "megatron.core.tensor_parallel.mappings": (
        "torch.cuda.current_device() as the output device of _gather_along_first_dim, "
        "_reduce_scatter_along_first_dim and _AllToAll.forward (the dispatcher's all-to-all-v)"
    ),
    "megatron.core.tensor_parallel.layers": (
        "torch.cuda.current_device() in Column/RowParallelLinear and VocabParallelEmbedding when "
        "use_cpu_initialization=False, and in the sequence-parallel all-gather of the linear autograd function"
    ),
    "megatron.core.tensor_parallel.utils": (
        "torch.cuda.current_device() in split_tensor_into_1d_equal_chunks / gather_split_1d_tensor"
    ),
    "megatron.core.tensor_parallel.random": (
        "torch.cuda.manual_seed / get_rng_state in CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed"
    ),
    "megatron.core.utils": (
        "torch.cuda.current_device() in GlobalMemoryBuffer.get_tensor (the local DotProductAttention's "
        "score buffer, via parallel_state.get_global_memory_buffer)"
    ),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        "torch.cuda.current_device() in RotaryEmbedding when use_cpu_initialization=False"
    ),
}

# Class attributes that upstream fills once per process with a torch.cuda object (while patched: a null
# stand-in, which would outlive the patch and be used on GPU after removal). SharedExpertMLP's ``stream``
# is set per instance, so it goes with the module that holds it.
CUDA_OBJECT_CACHES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "megatron.core.transformer.moe.token_dispatcher": (("MoEAlltoAllTokenDispatcher", "cuda_dtoh_stream"),),
}


def _give_cpu_cuda(patch: str, module_name: str) -> None:
    """Replaces the module's ``torch`` global (the calls listed in CPU_DEVICE_MODULES[module_name])."""
    module = _target(patch, module_name)
    if _target(patch, module_name, "torch") is not torch:
        raise RuntimeError(
            f"CPU patch {patch!r}: {module_name}.torch is not the torch module (something else "
            "replaced it); remove that other patch or run without it"
        )
    _replace(module, "torch", TORCH_ON_CPU)
    for class_name, attr in CUDA_OBJECT_CACHES.get(module_name, ()):
        _target(patch, module_name, f"{class_name}.{attr}")
        _record(getattr(module, class_name), attr)


# --------------------------------------------------------------------------------------------------
# Function patches; each docstring names the upstream call it replaces.


def _patch_split_sizes_to_host(patch: str) -> None:
    """Stands in for ``moe_utils.maybe_move_tensor_to_cpu`` as imported by ``token_dispatcher``.

    Upstream turns the all-to-all split sizes into numpy arrays only for CUDA tensors; CPU tensors stay
    tensors and ``torch.distributed.all_to_all_single`` then rejects them as split sizes (TypeError).
    """
    module_name = "megatron.core.transformer.moe.token_dispatcher"
    upstream = _target(patch, module_name, "maybe_move_tensor_to_cpu")

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace(_target(patch, module_name), "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _patch_router_gemm_name(patch: str) -> None:
    """Binds ``moe_utils.te_general_gemm`` to ``None`` for ``RouterGatingLinearFunction.forward/backward``.

    In 0.16.1 they test ``te_general_gemm is not None``, but the name is only bound inside the
    ``try: import transformer_engine`` block, so without TE it raises NameError (and TE's gemm is GPU-only
    where it is bound). With ``None`` they take their own torch.mm path.
    """
    module_name = "megatron.core.transformer.moe.moe_utils"
    _target(patch, module_name, "RouterGatingLinearFunction")
    _replace(_target(patch, module_name), "te_general_gemm", None)


def _patch_rng_state_functions(patch: str) -> None:
    """Stands in for ``tensor_parallel.random._get_cuda_rng_state`` and ``_set_cuda_rng_state``.

    Upstream reads the CUDA generator (raises without CUDA) and sets it through ``torch.cuda._lazy_call``,
    which without CUDA queues the call forever: ``CudaRNGStatesTracker.fork`` would switch nothing and leak
    one queued call per fork. On CPU the tracker's states are states of the CPU generator.
    """
    module_name = "megatron.core.tensor_parallel.random"
    _target(patch, module_name, "_get_cuda_rng_state")
    _target(patch, module_name, "_set_cuda_rng_state")

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    module = _target(patch, module_name)
    _replace(module, "_get_cuda_rng_state", _get_cuda_rng_state)
    _replace(module, "_set_cuda_rng_state", _set_cuda_rng_state)


class _ForkWarningFilter(logging.Filter):
    """Drops the warning ``CudaRNGStatesTracker.fork`` logs when the CPU generator moved inside a fork.

    On GPU that warning flags CPU randomness inside a CUDA-RNG region; on CPU the forked generator *is* the
    CPU generator, so every random op inside a fork (dropout, initialisation) would trigger it falsely.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_FILTER = _ForkWarningFilter()


def _patch_fork_warning(patch: str) -> None:
    """Filters the false CPU-RNG warning of ``tensor_parallel.random.CudaRNGStatesTracker.fork``."""
    module_name = "megatron.core.tensor_parallel.random"
    _target(patch, module_name, "CudaRNGStatesTracker.fork")
    logger = logging.getLogger(module_name)
    logger.addFilter(_FORK_FILTER)
    _ORIGINALS.append((logger, _FILTER_MARK, _FORK_FILTER))


def _patch_default_causal_mask(patch: str) -> None:
    """Stands in for ``transformer.utils.get_default_causal_mask`` (and the name ``fusions.fused_softmax``
    imported from it), which builds the mask with ``device="cuda"``; used by the local DotProductAttention's
    softmax when no attention mask is given."""
    owners = ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax")
    for module_name in owners:
        _target(patch, module_name, "get_default_causal_mask")

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    for module_name in owners:
        _replace(_target(patch, module_name), "get_default_causal_mask", get_default_causal_mask)


def _patch_uncompiled_expert_bias_count(patch: str) -> None:
    """Stands in for ``router.TopKRouter._apply_expert_bias`` with its undecorated body.

    Upstream wraps it in ``megatron.core.jit.jit_fuser`` (``torch.compile``); on CPU inductor then builds C++
    for this one token count at the first call of every process (about 18 s here, again for new shapes).
    The body is a ``routing_map.sum(0)`` accumulation: plain eager torch is as fast.
    """
    module_name = "megatron.core.transformer.moe.router"
    eager = _target(patch, module_name, "TopKRouter._apply_expert_bias._torchdynamo_orig_callable")
    _replace(_target(patch, module_name, "TopKRouter"), "_apply_expert_bias", eager)


def _no_shm_op() -> None:
    """No shared-memory op: DeepSpeed's TorchBackend then reduces through the process group (gloo)."""
    return None


def _patch_deepspeed_shm_op(patch: str) -> None:
    """Stands in for ``deepspeed.comm.torch.build_shm_op``, called by ``TorchBackend.__init__`` (that is, by
    ``deepspeed.init_distributed``).

    On the CPU accelerator upstream JIT-builds a shared-memory all-reduce op at the first distributed start
    (minutes, needs g++, cached under ~/.cache/torch_extensions), and its bf16 kernels fault without AVX-512.
    gloo performs the same reductions, which is what TorchBackend does when the op is None.
    """
    module_name = "deepspeed.comm.torch"
    _target(patch, module_name, "build_shm_op")
    _replace(_target(patch, module_name), "build_shm_op", _no_shm_op)


_FUNCTION_PATCHES: Dict[str, Callable[[str], None]] = {
    "token_dispatcher.maybe_move_tensor_to_cpu": _patch_split_sizes_to_host,
    "moe_utils.te_general_gemm": _patch_router_gemm_name,
    "random.cuda_rng_state": _patch_rng_state_functions,
    "random.fork_warning": _patch_fork_warning,
    "router.TopKRouter._apply_expert_bias": _patch_uncompiled_expert_bias_count,
    "transformer.utils.get_default_causal_mask": _patch_default_causal_mask,
    "deepspeed.comm.torch.build_shm_op": _patch_deepspeed_shm_op,
}

_PATCHES: Dict[str, Callable[[str], None]] = {
    **{
        f"torch.cuda@{module_name}": (lambda patch, m=module_name: _give_cpu_cuda(patch, m))
        for module_name in CPU_DEVICE_MODULES
    },
    **_FUNCTION_PATCHES,
}

# Every patch this module applies, in order.
CPU_PATCH_NAMES: Tuple[str, ...] = tuple(_PATCHES)


def apply_cpu_patches() -> List[str]:
    """Apply every CPU stand-in, once; return the names applied (all of ``CPU_PATCH_NAMES``).

    Idempotent: a second call changes nothing and returns the same list. Call it before building megatron
    modules or starting DeepSpeed. Raises RuntimeError where ``torch.cuda.is_available()`` (hide the GPUs
    with ``CUDA_VISIBLE_DEVICES=""`` for a CPU run) and where a patch's upstream target is missing (naming
    both); after a failure nothing stays patched.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "apply_cpu_patches: CUDA is available in this process, and the CPU stand-ins would replace "
            "megatron-core's and DeepSpeed's GPU paths. For a CPU run hide the GPUs before Python starts "
            "(CUDA_VISIBLE_DEVICES=\"\", as run_distributed(backend='gloo') does for its ranks); for a GPU run "
            "use prepare_device('cuda') instead"
        )
    if _APPLIED:
        return list(_APPLIED)
    try:
        for name, patch in _PATCHES.items():
            patch(name)
            _APPLIED.append(name)
    except BaseException:
        remove_cpu_patches()
        raise
    return list(_APPLIED)


def remove_cpu_patches() -> None:
    """Restore every replaced attribute, and the class-level stream caches of ``CUDA_OBJECT_CACHES`` (so the
    next dispatcher built makes a real stream again); meant for tests.

    It does not convert state built while patched: megatron's RNG tracker keeps the CPU generator states it
    was seeded with (call ``model_parallel_cuda_manual_seed`` again), and modules constructed under the
    patches keep their CPU buffers and null streams (build them again)."""
    while _ORIGINALS:
        owner, attr, original = _ORIGINALS.pop()
        if attr == _FILTER_MARK:
            owner.removeFilter(original)
        elif original is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _APPLIED.clear()


def cpu_patches_applied() -> List[str]:
    """Names of the patches currently applied: ``CPU_PATCH_NAMES`` after ``apply_cpu_patches()``, else empty."""
    return list(_APPLIED)
