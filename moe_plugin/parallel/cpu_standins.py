"""CPU stand-ins for the ``torch.cuda`` objects megatron-core touches on its MoE path.

``moe_plugin.parallel.cpu_compat`` hands ``TORCH_ON_CPU`` to selected megatron-core modules as their ``torch``
global: a view of torch whose ``torch.cuda`` reports the CPU device, hands out streams and events that never
need waiting for (CPU work is synchronous) and makes the CPU generator play the device generator. Every other
attribute is looked up live on the real module, so nothing outside the patched modules sees a change.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch

__all__ = ["NullEvent", "NullStream", "TorchCudaOnCpu", "TorchWithCpuCuda", "TORCH_ON_CPU"]


class NullEvent:
    """A CUDA event on a device that runs everything synchronously: already complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class NullStream:
    """A CUDA stream on a device with one implicit, synchronous stream: waiting is never needed."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Optional[NullEvent] = None) -> NullEvent:
        return event or NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = NullStream()


class TorchCudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen by a patched megatron-core module: CPU device, null streams, CPU RNG."""

    def __init__(self):
        super().__init__("torch.cuda", "torch.cuda with CPU stand-ins (moe_plugin.parallel.cpu_compat)")
        self.Stream = NullStream
        self.Event = NullEvent

    def __getattr__(self, name: str) -> Any:  # everything not overridden below stays torch.cuda's
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        """The CPU device. Upstream returns the CUDA device's index (an int), but every caller in the patched
        modules passes it on as a device (``device=``, ``.to(...)``), where an int would mean ``cuda:N``; the
        one place that indexes with it (``random._get/_set_cuda_rng_state``) is replaced as a whole."""
        return torch.device("cpu")

    @staticmethod
    def current_stream(device: Any = None) -> NullStream:
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


class TorchWithCpuCuda(types.ModuleType):
    """The ``torch`` module with ``torch.cuda`` replaced; all other attributes are looked up live."""

    def __init__(self):
        super().__init__("torch", "torch with a CPU torch.cuda (moe_plugin.parallel.cpu_compat)")
        self.cuda = TorchCudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


TORCH_ON_CPU = TorchWithCpuCuda()
