"""Every CPU adaptation megatron-core needs, in one place, applied only when CUDA is absent.

megatron-core assumes a GPU in a handful of calls on its MoE path (streams and events in the all-to-all
dispatcher, ``torch.cuda.current_device()`` as an allocation device, the CUDA RNG tracker). On a machine
without CUDA each of them raises, although the math around them is plain torch and runs on CPU tensors
with the ``gloo`` backend. ``apply_cpu_patches()`` gives each such call a CPU stand-in by replacing module
attributes of megatron-core (never torch itself, so nothing outside megatron-core sees a change).

Two kinds of patch:

* *CUDA namespace* patches replace the ``torch`` global of one megatron-core module by a view of torch
  whose ``torch.cuda`` answers ``current_device()`` with the CPU device and hands out do-nothing streams
  and events. Every other attribute is torch's own. This keeps upstream functions intact instead of
  copying them just to change one device argument.
* *Function* patches swap one upstream function or global for a CPU version.

Supported versions: megatron-core 0.16.1, tested on Python 3.11 with torch 2.13 (CPU). megatron-core
0.17 and newer (Python >= 3.12) are expected to need the same calls; every patch first checks that its
target exists and is left out (not listed in ``cpu_patches_applied()``) when it does not, so a newer
version degrades to the patches that still apply. Re-test the list when the version moves.

With CUDA present ``apply_cpu_patches()`` does nothing: the GPU paths stay exactly upstream. A CPU run on a
machine with GPUs hides them from its processes (``CUDA_VISIBLE_DEVICES=""``, as
``moe_plugin.parallel.launch.run_distributed`` does for ``gloo``) so that the stand-ins apply there too.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["apply_cpu_patches", "remove_cpu_patches", "cpu_patches_applied", "CPU_PATCH_NAMES",
           "CPU_DEVICE_MODULES"]

# --------------------------------------------------------------------------------------------------
# CPU stand-ins for the torch.cuda objects megatron-core touches.


class _NullEvent:
    """A CUDA event on a device that runs everything synchronously: already complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """A CUDA stream on a device with one implicit, synchronous stream: waiting is never needed."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Optional[_NullEvent] = None) -> _NullEvent:
        return event or _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NullStream()


class _TorchCudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen by a patched megatron-core module: CPU device, null streams, CPU RNG."""

    def __init__(self):
        super().__init__("torch.cuda", "torch.cuda with CPU stand-ins (moe_plugin.parallel.cpu_compat)")
        self.Stream = _NullStream
        self.Event = _NullEvent

    def __getattr__(self, name: str) -> Any:  # everything not overridden below stays torch.cuda's
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        """The CPU device. Upstream returns the CUDA device's index (an int), but every caller in the patched
        modules passes it on as a device (``device=``, ``.to(...)``), where an int would mean ``cuda:N``; the
        one place that indexes with it (``random._get/_set_cuda_rng_state``) is replaced as a whole."""
        return torch.device("cpu")

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    # The CPU generator plays the device generator: megatron's RNG tracker seeds and snapshots it.
    @staticmethod
    def manual_seed(seed: int) -> None:
        """Seeds torch's global CPU generator. ``model_parallel_cuda_manual_seed(seed)`` calls this with the
        same seed on every rank, so on CPU everything initialised from the default generator afterwards is
        identical across ranks. Upstream on GPU seeds only the CUDA generator and leaves the CPU one as the
        caller left it: a GPU run gets rank-identical CPU-initialised weights only if the caller also calls
        ``torch.manual_seed`` (``moe_plugin.parallel.distributed.initialize_megatron`` does)."""
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()


class _TorchWithCpuCuda(types.ModuleType):
    """The ``torch`` module with ``torch.cuda`` replaced; all other attributes are looked up live."""

    def __init__(self):
        super().__init__("torch", "torch with a CPU torch.cuda (moe_plugin.parallel.cpu_compat)")
        self.cuda = _TorchCudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchWithCpuCuda()

# --------------------------------------------------------------------------------------------------
# Bookkeeping: every replaced attribute is recorded so that remove_cpu_patches() can restore it.

_ORIGINALS: List[Tuple[Any, str, Any]] = []
_APPLIED: List[str] = []
_ABSENT = object()  # recorded original of an attribute that did not exist: removal deletes it
_FILTER_MARK = "<log filter>"  # recorded "attribute" of a logging filter: removal detaches it


def _replace(owner: Any, attr: str, value: Any) -> None:
    _ORIGINALS.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def _record(owner: Any, attr: str) -> None:
    """Remember ``owner.attr`` without changing it, for an attribute that upstream fills in later."""
    _ORIGINALS.append((owner, attr, getattr(owner, attr)))


def _module(name: str) -> Optional[types.ModuleType]:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _give_cpu_cuda(module_name: str) -> bool:
    module = _module(module_name)
    if module is None or getattr(module, "torch", None) is not torch:
        return False
    _replace(module, "torch", _TORCH_ON_CPU)
    for class_name, attr in CUDA_OBJECT_CACHES.get(module_name, ()):
        owner = getattr(module, class_name, None)
        if owner is not None and hasattr(owner, attr):
            _record(owner, attr)
    return True


# --------------------------------------------------------------------------------------------------
# CUDA namespace patches, one per megatron-core module. Each docstring names the upstream calls.

# module -> the upstream calls in it that the CPU torch.cuda stands in for
CPU_DEVICE_MODULES: Dict[str, str] = {
    "megatron.core.transformer.moe.token_dispatcher":
        "torch.cuda.Stream() in MoEAlltoAllTokenDispatcher.__init__; torch.cuda.current_stream / "
        "torch.cuda.stream / Stream.record_event in MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "megatron.core.transformer.moe.router":
        "torch.cuda.current_device() in Router.gating (moves the gate weight) and in TopKRouter.__init__ "
        "(expert-bias and global-aux-loss buffers)",
    "megatron.core.transformer.moe.shared_experts":
        "torch.cuda.Stream / current_stream / stream in SharedExpertMLP (moe_shared_expert_overlap)",
    "megatron.core.tensor_parallel.mappings":
        "torch.cuda.current_device() as the output device of _gather_along_first_dim, "
        "_reduce_scatter_along_first_dim and _AllToAll.forward (the dispatcher's all-to-all-v)",
    "megatron.core.tensor_parallel.layers":
        "torch.cuda.current_device() in Column/RowParallelLinear and VocabParallelEmbedding when "
        "use_cpu_initialization=False, and in the sequence-parallel all-gather of the linear autograd function",
    "megatron.core.tensor_parallel.utils":
        "torch.cuda.current_device() in split_tensor_into_1d_equal_chunks / gather_split_1d_tensor",
    "megatron.core.tensor_parallel.random":
        "torch.cuda.manual_seed / get_rng_state in CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed",
    "megatron.core.utils":
        "torch.cuda.current_device() in GlobalMemoryBuffer.get_tensor (the local DotProductAttention's "
        "score buffer, via parallel_state.get_global_memory_buffer)",
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "torch.cuda.current_device() in RotaryEmbedding when use_cpu_initialization=False",
}


# Class attributes that upstream fills once per process with a torch.cuda object (while patched: a null
# stand-in, which would outlive the patch and be used on GPU after removal). SharedExpertMLP's ``stream``
# is set per instance, so it goes with the module that holds it.
CUDA_OBJECT_CACHES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "megatron.core.transformer.moe.token_dispatcher": (("MoEAlltoAllTokenDispatcher", "cuda_dtoh_stream"),),
}


def _patch_cuda_namespaces() -> List[str]:
    """Give each module of CPU_DEVICE_MODULES the CPU ``torch.cuda`` (see that table for the calls)."""
    return [f"torch.cuda@{name}" for name in CPU_DEVICE_MODULES if _give_cpu_cuda(name)]


# --------------------------------------------------------------------------------------------------
# Function patches.


def _patch_split_sizes_to_host() -> bool:
    """Stands in for ``moe_utils.maybe_move_tensor_to_cpu`` as imported by ``token_dispatcher``.

    Upstream turns the all-to-all split sizes into numpy arrays only for CUDA tensors; CPU tensors stay
    tensors and ``torch.distributed.all_to_all_single`` then rejects them as split sizes (TypeError).
    """
    module = _module("megatron.core.transformer.moe.token_dispatcher")
    upstream = getattr(module, "maybe_move_tensor_to_cpu", None)
    if upstream is None:
        return False

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace(module, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    return True


def _patch_router_gemm_name() -> bool:
    """Defines ``moe_utils.te_general_gemm`` as ``None`` where the TransformerEngine import failed.

    In 0.16.1 ``RouterGatingLinearFunction.forward`` tests ``te_general_gemm is not None``, but the name is
    only bound inside the ``try: import transformer_engine`` block, so without TE it raises NameError.
    With ``None`` it takes its own torch.mm path.
    """
    module = _module("megatron.core.transformer.moe.moe_utils")
    if module is None or hasattr(module, "te_general_gemm") or not hasattr(module, "RouterGatingLinearFunction"):
        return False
    _ORIGINALS.append((module, "te_general_gemm", _ABSENT))
    module.te_general_gemm = None
    return True


def _patch_rng_state_functions() -> bool:
    """Stands in for ``tensor_parallel.random._get_cuda_rng_state`` and ``_set_cuda_rng_state``.

    Upstream reads the CUDA generator (raises without CUDA) and sets it through ``torch.cuda._lazy_call``,
    which without CUDA queues the call forever: ``CudaRNGStatesTracker.fork`` would switch nothing and leak
    one queued call per fork. On CPU the tracker's states are states of the CPU generator.
    """
    module = _module("megatron.core.tensor_parallel.random")
    if module is None or not hasattr(module, "_get_cuda_rng_state") or not hasattr(module, "_set_cuda_rng_state"):
        return False

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    _replace(module, "_get_cuda_rng_state", _get_cuda_rng_state)
    _replace(module, "_set_cuda_rng_state", _set_cuda_rng_state)
    return True


class _ForkWarningFilter(logging.Filter):
    """Drops the warning ``CudaRNGStatesTracker.fork`` logs when the CPU generator moved inside a fork.

    On GPU that warning flags CPU randomness inside a CUDA-RNG region; on CPU the forked generator *is* the
    CPU generator, so every random op inside a fork (dropout, initialisation) would trigger it falsely.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_FILTER = _ForkWarningFilter()


def _patch_fork_warning() -> bool:
    """Filters the false CPU-RNG warning of ``tensor_parallel.random.CudaRNGStatesTracker.fork``."""
    if _module("megatron.core.tensor_parallel.random") is None:
        return False
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    logger.addFilter(_FORK_FILTER)
    _ORIGINALS.append((logger, _FILTER_MARK, _FORK_FILTER))
    return True


def _patch_default_causal_mask() -> bool:
    """Stands in for ``transformer.utils.get_default_causal_mask`` (and the name ``fusions.fused_softmax``
    imported from it), which builds the mask with ``device="cuda"``; used by the local DotProductAttention's
    softmax when no attention mask is given."""
    utils = _module("megatron.core.transformer.utils")
    softmax = _module("megatron.core.fusions.fused_softmax")
    if utils is None or not hasattr(utils, "get_default_causal_mask"):
        return False

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    _replace(utils, "get_default_causal_mask", get_default_causal_mask)
    if softmax is not None and hasattr(softmax, "get_default_causal_mask"):
        _replace(softmax, "get_default_causal_mask", get_default_causal_mask)
    return True


def _patch_uncompiled_expert_bias_count() -> bool:
    """Stands in for ``router.TopKRouter._apply_expert_bias`` with its undecorated body.

    Upstream wraps it in ``megatron.core.jit.jit_fuser`` (``torch.compile``); on CPU inductor then builds C++
    for this one token count at the first call of every process (about 18 s here, again for new shapes).
    The body is a ``routing_map.sum(0)`` accumulation: plain eager torch is as fast.
    """
    module = _module("megatron.core.transformer.moe.router")
    router_cls = getattr(module, "TopKRouter", None)
    compiled = getattr(router_cls, "_apply_expert_bias", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None:
        return False
    _replace(router_cls, "_apply_expert_bias", eager)
    return True


_FUNCTION_PATCHES: Dict[str, Callable[[], bool]] = {
    "token_dispatcher.maybe_move_tensor_to_cpu": _patch_split_sizes_to_host,
    "moe_utils.te_general_gemm": _patch_router_gemm_name,
    "random.cuda_rng_state": _patch_rng_state_functions,
    "random.fork_warning": _patch_fork_warning,
    "router.TopKRouter._apply_expert_bias": _patch_uncompiled_expert_bias_count,
    "transformer.utils.get_default_causal_mask": _patch_default_causal_mask,
}

# Every patch this module can apply, in order.
CPU_PATCH_NAMES: Tuple[str, ...] = tuple(f"torch.cuda@{m}" for m in CPU_DEVICE_MODULES) + tuple(_FUNCTION_PATCHES)


def apply_cpu_patches() -> List[str]:
    """Apply every CPU stand-in whose target exists, once; return the names applied (empty with CUDA).

    Idempotent: a second call changes nothing and returns the same list. Call it before building megatron
    modules (``moe_plugin.parallel.distributed.initialize_megatron`` does).
    """
    if torch.cuda.is_available() or _APPLIED:
        return list(_APPLIED)
    _APPLIED.extend(_patch_cuda_namespaces())
    _APPLIED.extend(name for name, patch in _FUNCTION_PATCHES.items() if patch())
    return list(_APPLIED)


def remove_cpu_patches() -> None:
    """Restore every replaced attribute of megatron-core, and the class-level stream caches of
    ``CUDA_OBJECT_CACHES`` (so the next dispatcher built makes a real stream again); meant for tests.

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
    """Names of the patches currently applied (a subset of ``CPU_PATCH_NAMES``)."""
    return list(_APPLIED)
