"""torch's FSDP2 behind the loop (``parallel.sharding: "fsdp2"``, megatron backend).

The model comes built, with its base loaded and its adapters on (so every adapter is sharded with the layer it
belongs to and trained as one tensor across the ranks). Then:

* ``fully_shard`` per decoder layer (``Backend.shard_units``) and on the root, over the layout's data x context
  mesh (``ParallelLayout.dense_mesh``: every rank; context-parallel ranks hold other tokens of the same rows, so
  they reduce like data-parallel ones). Each layer's parameters are gathered for its forward and freed after it
  (``parallel.reshard_after_forward``, default true; false keeps them gathered until the backward, trading
  memory for a second gather); the root's own (embedding, final norm, output layer) stay gathered from
  forward to backward, as their backward comes first.
* The routed experts (megatron's mark ``allreduce = False``: the local experts and their adapters) are
  ``ignored_params``: they stay whole on their expert-parallel rank, as the layout placed them, so a frozen
  packed MXFP4/INT4 stack is never cast, unpacked or gathered. Their gradients (the all-to-all backward already
  summed every EP rank's tokens into them) are summed over the expert-data-parallel group and divided by the
  data x context size, as ZeRO-3 does for its expert partitions (docs/zero3-ep.md).
* Precision (``schedule.precision``): fp32 runs everything in fp32; bf16 gathers the sharded parameters in bf16
  for compute and reduces gradients in fp32 (``MixedPrecisionPolicy``), and stores the frozen floating-point
  experts it does not gather in bf16 (as DeepSpeed's bf16 engine stores every parameter; the expert adapters stay
  fp32 masters); the fp32 tensors the precision policy keeps exact are buffers already (docs/precision.md) and
  FSDP2 leaves buffers alone.
* Gradient accumulation: ``loss / A`` on every micro-batch; FSDP2's reduce-scatter and the experts' all-reduce
  run only after the last (``set_requires_gradient_sync``).
* The step: one global norm over both meshes, ``sqrt(dense + experts)``: the sharded gradients' squares summed
  over the mesh, the experts' over the expert-parallel group (an expert-data-parallel peer holds the same
  experts: counted once), clipped with torch's coefficient ``max_norm / (norm + 1e-6)``; then a torch AdamW
  over the sharded parameters and the schedule.

Checkpoints: no files of its own; the layout-free state (``trainable_state.py``) is the checkpoint, each tensor
gathered whole from its shards (``DTensor.full_tensor``) and written back by slicing (``distribute_tensor``
without communication: every rank reads the same whole tensor).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ...compat.deepspeed import adam_states
from ...parallel.grad_reduce import is_expert_parameter
from ...parallel.zero3_gather import mark_sharded_owners
from ..trainable_state import MOMENTS
from .base import Engine, adamw

__all__ = ["FSDP2Engine", "mixed_precision"]

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s, added to the norm before dividing


def mixed_precision(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for ``schedule.precision``: none for fp32; bf16 compute with fp32
    gradient reduction for bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class FSDP2Engine(Engine):
    """``fully_shard`` over the built ``model`` (module docstring); ``config`` is None."""

    name = "fsdp2"

    def __init__(self, model: nn.Module, recipe, layout, config=None, backend=None):
        from torch.distributed.fsdp import fully_shard

        self.layout, self.accumulation = layout, recipe.schedule.gradient_accumulation_steps
        self.max_norm = recipe.schedule.clip_grad_norm
        self.reshard_after_forward = recipe.parallel.reshard_after_forward
        self.device = device = backend.device if backend is not None else torch.device("cpu")
        self.mesh = layout.dense_mesh(device.type)
        experts = [p for p in model.parameters() if is_expert_parameter(p)]
        kept = {id(p) for p in experts}
        policy = mixed_precision(recipe.schedule.precision)
        if policy.param_dtype is not None:  # the frozen experts FSDP2 does not gather compute in its dtype too
            _cast_frozen(experts, policy.param_dtype)
        for unit in backend.shard_units(model) if backend is not None else []:
            fully_shard(
                unit,
                mesh=self.mesh,
                mp_policy=policy,
                reshard_after_forward=self.reshard_after_forward,
                ignored_params={p for p in unit.parameters() if id(p) in kept},
            )
        fully_shard(model, mesh=self.mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=set(experts))
        mark_sharded_owners(model)
        self.module = self.forward = model
        self.kept = kept
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.expert_trainable = [p for p in self.trainable if id(p) in kept]
        self._check_sharded()
        self.optimizer, self.lr_scheduler = adamw(self.trainable, recipe.schedule)
        self._steps = 0

    @staticmethod
    def config(recipe, world: int) -> None:
        return None  # the recipe's parallel and schedule sections say everything (schema refuses a DeepSpeed file)

    def describe(self) -> str:
        ranks = self.layout.gradient_ranks
        return (
            f"FSDP2 over {ranks} rank{'s' * (ranks != 1)}, routed experts whole on their expert-parallel rank, "
            f"reshard after forward {str(self.reshard_after_forward).lower()}"
        )

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.module.set_requires_gradient_sync(last)  # FSDP2 reduce-scatters after the last micro-batch only
        (loss / self.accumulation).backward()
        if last:
            self._reduce_expert_gradients()

    @torch.no_grad()
    def _reduce_expert_gradients(self) -> None:
        """The experts' gradients summed over the ranks that hold the same experts, over the data x context size
        (module docstring)."""
        layout = self.layout
        for p in self.expert_trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # an expert no token reached on this rank: its peers' may have
            if layout.expert_data > 1:
                dist.all_reduce(p.grad, group=layout.expert_data_group)
            p.grad.div_(layout.gradient_ranks)

    def _check_sharded(self) -> None:
        """Every trainable parameter is FSDP2's (a sharded ``DTensor``) or a routed expert's kept whole, and the
        optimizer holds each: an adapter attached after ``fully_shard`` would be a plain tensor each rank trained
        on its own (and, added after the optimizer was made, never stepped), with rank 0's saved."""
        from torch.distributed.tensor import DTensor

        stepped = {id(p) for p in self.trainable}
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if (id(p) not in self.kept and not isinstance(p, DTensor)) or id(p) not in stepped:
                raise ValueError(
                    f"{name}: a trainable parameter outside FSDP2's shards and the optimizer (added after the engine "
                    "sharded the model?); every rank would train its own copy of it. Put adapters on the model "
                    "before the engine is made (the backend's build adds them before fully_shard)"
                )

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """The norm of every trainable gradient of the model across all ranks (module docstring), fp64."""
        from torch.distributed.tensor import DTensor

        # on the device: NCCL reduces device tensors only
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.trainable:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):  # every trainable parameter but the routed experts is sharded
                dense += _squares(g.to_local())
            else:
                experts += _squares(g)
        if self.layout.gradient_ranks > 1:
            dist.all_reduce(dense, group=self.mesh.get_group())
        if self.layout.expert > 1:
            dist.all_reduce(experts, group=self.layout.expert_group)
        return math.sqrt(float(dense + experts))

    @torch.no_grad()
    def step(self, last: bool) -> Optional[float]:
        if not last:
            return None
        self._check_sharded()
        norm = self.global_grad_norm()
        if self.max_norm is not None:
            coefficient = self.max_norm / (norm + EPS)
            if coefficient < 1.0:
                for p in self.trainable:
                    if p.grad is not None:
                        p.grad.mul_(coefficient)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return norm

    def train(self) -> None:
        self._reshard()
        self.module.train()

    def eval(self) -> None:
        self._reshard()
        self.module.eval()

    def _reshard(self) -> None:
        """Every layer's shards registered again: a forward without a backward (evaluation) leaves the root's
        parameters gathered (it does not reshard after its forward), and what reads the model next (the
        outputs, a checkpoint) must find the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    def resumed_at(self, step: int, global_batch: int) -> None:
        self._steps = step

    def whole_fp32(self, p: nn.Parameter) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = adam_states(self.optimizer).get(p, {})
        value = _whole(p)
        return (value,) + tuple(_whole(state[k]) if k in state else torch.zeros_like(value) for k in MOMENTS)

    @torch.no_grad()
    def set_whole(self, p: nn.Parameter, value: torch.Tensor, moments: Tuple[torch.Tensor, ...], step: int) -> None:
        p.copy_(_shard_like(p, value))
        adam_states(self.optimizer)[p] = {
            "step": torch.tensor(float(step)),
            **{k: _shard_like(p, m).clone() for k, m in zip(MOMENTS, moments)},
        }


@torch.no_grad()
def _cast_frozen(params, dtype: torch.dtype) -> None:
    """The frozen floating-point ones of ``params`` stored in ``dtype`` (as DeepSpeed's bf16 engine stores every
    parameter); packed integer experts and trainable tensors (fp32 masters) stay as they are."""
    for p in params:
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _squares(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s squared elements (its fp32 norm, squared in fp64)."""
    return torch.linalg.vector_norm(t.float()).double() ** 2


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole, fp32, on the CPU (a ``DTensor``: gathered over its mesh, collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu()


def _shard_like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (the global shape of ``p``) as ``p`` holds it: this rank's shard of a ``DTensor`` (sliced here,
    no communication: every rank has the whole tensor), or itself, in ``p``'s dtype and device."""
    from torch.distributed.tensor import DTensor

    whole = whole.view(p.shape).to(device=p.device, dtype=p.dtype)
    if isinstance(p, DTensor):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    return whole
