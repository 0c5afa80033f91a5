"""The parallel layout of a run: every parallel size and the process groups behind them, in one object.

torchtitan's ``ParallelDims`` is the model. A ``ParallelLayout`` is built once from the recipe (``from_recipe``)
or from the sizes a Hugging Face Trainer user names; its sizes are checked when it is built, before any process
group exists. ``start()`` then starts megatron-core's parallel state for it (tensor-, expert-, data- and
expert-data-parallel groups, as megatron lays them out: expert-parallel groups of ``expert`` consecutive ranks)
and DeepSpeed's expert groups, and checks that both agree with the layout and with each other. The layout also
owns the rule for the expert tags (``tag_expert_parameters``): which parameters ZeRO-3 partitions within the
expert-data-parallel group, and when megatron's expert mark is removed instead.

The sizes, with ``world = data x context x tensor`` and ``world = expert x expert_data x tensor``:

* ``data``: the data-parallel size, how many ranks read their own batches (every rank but tensor- and
  context-parallel peers);
* ``context``: the context-parallel size, how many ranks split each packed row into contiguous slices
  (docs/context-parallel.md); they read the same batches and, like data-parallel ranks, average their
  gradients, so the engine averages over ``gradient_ranks = data x context``;
* ``expert``: the expert-parallel size, how many ranks split each MoE layer's experts (all-to-all dispatch);
* ``expert_data``: how many ranks hold the same experts; ZeRO-3 partitions an expert parameter, and reduces its
  gradient, within them.

As megatron lays them out, the context-parallel groups are ``context`` consecutive ranks, and expert
parallelism is carved from the data x context ranks: experts see the tokens of every context rank.

Why the tags (docs/zero3-ep.md has DeepSpeed's source lines and what goes wrong without them): ZeRO-3
partitions every parameter over its ``ds_process_group``, taken from ``ds_zero_partition_process_group`` when
set. An expert parameter (megatron's mark ``allreduce = False``: the local experts and their LoRA adapters)
exists only on its expert-parallel rank, so it is partitioned, and its gradient reduced, within the
expert-data-parallel group; ``ds_zero_placement_family = "autoep_expert"`` makes the engine divide its gradient
by the whole data-parallel size (the all-to-all backward already summed every EP rank's tokens into it) and add
the expert-parallel all-reduce to the gradient norm; ``group_name = "ep_size_{EP}"`` names DeepSpeed's own expert
groups, which ``start`` builds and checks equal to megatron's. The engine's own placement step never runs for a
model without DeepSpeed-MoE layers, so the tags are the project's job (``megatron.expert_tags``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from ..compat.deepspeed import expert_groups
from ..config import require
from ..expert_adapters import experts_held
from ..megatron.expert_tags import group_name, tag_expert_parameter
from .grad_reduce import is_expert_parameter

__all__ = ["ParallelLayout", "SHARDINGS", "started_layout", "hide_expert_marks", "experts_held"]

SHARDINGS = ("zero3", "fsdp2")  # parallel.sharding: DeepSpeed's ZeRO-3 engine, torch's FSDP2 (training/engines)

_STARTED: List["ParallelLayout"] = []  # the layout whose groups this process started (one at most)


def _positive(name: str, value: object) -> int:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        name,
        f"must be a positive integer, got {value!r}",
    )
    return value


@dataclass
class ParallelLayout:
    """The sizes of one run's parallel dimensions (module docstring); ``start()`` makes their groups."""

    world: int
    expert: int = 1
    tensor: int = 1
    context: int = 1
    sharding: str = "zero3"  # the engine that shards the model: "zero3" (DeepSpeed) or "fsdp2" (torch's)
    started: bool = field(default=False, init=False, compare=False)
    _meshes: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        _positive("world size (WORLD_SIZE)", self.world)
        _positive("parallel.expert_parallel_size", self.expert)
        _positive("tensor_model_parallel_size", self.tensor)
        _positive("parallel.context_parallel_size", self.context)
        require(
            self.sharding in SHARDINGS,
            "parallel.sharding",
            f"expected one of {list(SHARDINGS)}, got {self.sharding!r}",
        )
        require(
            self.world % (self.context * self.tensor) == 0,
            "parallel.context_parallel_size",
            f"context x tensor parallel size ({self.context} x {self.tensor}) must divide the world size "
            f"{self.world}; launch a multiple of {self.context * self.tensor} processes",
        )
        require(
            self.world % (self.expert * self.tensor) == 0,
            "parallel.expert_parallel_size",
            f"expert x tensor parallel size ({self.expert} x {self.tensor}) must divide the world size "
            f"{self.world}; launch a multiple of {self.expert * self.tensor} processes",
        )

    @classmethod
    def from_recipe(cls, parallel, world: int) -> "ParallelLayout":
        """The layout of a recipe's ``parallel`` section on ``world`` processes."""
        return cls(
            world=world,
            expert=parallel.expert_parallel_size,
            context=parallel.context_parallel_size,
            sharding=parallel.sharding,
        )

    @property
    def data(self) -> int:
        return self.world // (self.tensor * self.context)

    @property
    def gradient_ranks(self) -> int:
        """How many ranks the engine averages the dense gradients over: data x context (context-parallel
        ranks hold different tokens of the same rows, as data-parallel ranks hold different rows)."""
        return self.data * self.context

    @property
    def expert_data(self) -> int:
        return self.world // (self.expert * self.tensor)

    # ---- the groups (after start) ----

    def start(self, seed: Optional[int] = None, device: Optional[str] = None) -> "ParallelLayout":
        """Start megatron-core's parallel state and DeepSpeed's expert groups for this layout (torch.distributed
        is started first if it is not up) and check that they agree; returns self. Collective.

        ``seed``: seeds torch's default generator and megatron's RNG tracker (``initialize_megatron``); None
        leaves the RNG alone. ``device``: prepares this process for it when it was not prepared yet.
        """
        from ..compat import deepspeed as ds_compat
        from ..compat import megatron as megatron_compat
        from .distributed import initialize_megatron

        initialize_megatron(
            expert_model_parallel_size=self.expert,
            tensor_model_parallel_size=self.tensor,
            context_parallel_size=self.context,
            seed=seed,
            device=device,
        )
        require(
            dist.get_world_size() == self.world,
            "world size (WORLD_SIZE)",
            f"the layout is for {self.world} processes but torch.distributed has {dist.get_world_size()}",
        )
        self._check_megatron()
        if self.sharding == "zero3":  # ZeRO-3 reduces expert gradients over DeepSpeed's own expert groups
            import deepspeed

            # DeepSpeed's communication layer wraps the process group that is up (idempotent)
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
            ds_compat.use_current_collectives()
            self._check_deepspeed()
        # torch's current collectives, not the deprecated aliases megatron-core (and DeepSpeed, above) bind, whose
        # FutureWarnings ran through the progress bar on every rank: the recipe trainer's backends and the
        # Hugging Face Trainer's parallelize_experts all start their groups here
        megatron_compat.use_current_collectives()
        self.started = True
        _STARTED[:] = [self]
        return self

    def _check_megatron(self) -> None:
        from megatron.core import parallel_state as ps

        theirs = {
            "data": ps.get_data_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size(),
            "expert_data": ps.get_expert_data_parallel_world_size(),
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "context": ps.get_context_parallel_world_size(),
        }
        for name, size in theirs.items():
            if size != getattr(self, name):
                raise RuntimeError(
                    f"megatron's {name}-parallel size is {size}, the layout's {getattr(self, name)}: "
                    "megatron-core's parallel state was started for another layout"
                )

    def _check_deepspeed(self) -> None:
        """DeepSpeed's expert and expert-data-parallel groups are built for ``expert`` and must be megatron's:
        ZeRO-3 reduces expert gradients and norms over DeepSpeed's groups while the tags partition within
        megatron's (RuntimeError naming the group that differs)."""
        from megatron.core import parallel_state as ps

        ds_ep, ds_edp = expert_groups(self.expert, group_name(self.expert))  # moe_plugin.compat.deepspeed
        pairs = (
            ("expert-parallel", ds_ep, ps.get_expert_model_parallel_group()),
            ("expert-data-parallel", ds_edp, ps.get_expert_data_parallel_group()),
        )
        for what, ds_group, mg_group in pairs:
            ours, theirs = _ranks(ds_group), _ranks(mg_group)
            if ours != theirs:
                raise RuntimeError(
                    f"DeepSpeed's {what} group of rank {dist.get_rank()} is {ours}, megatron's is "
                    f"{theirs}: ZeRO-3 would reduce expert gradients over other ranks than hold them"
                )

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which batches it reads."""
        if not self.started:
            return dist.get_rank() // self.tensor
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def context_rank(self) -> int:
        """This process's context-parallel rank: which slice of every row it holds."""
        if not self.started or self.context == 1:
            return 0
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_rank()

    def context_slice(self, total: int, offsets=None):
        """This rank's ``ContextSlice`` of a row of ``total`` tokens with document ``offsets`` (host ints), over
        the context-parallel group; None without context parallelism."""
        if self.context == 1:
            return None
        require(self.started, "parallel.context_parallel_size", "needs the layout's groups started (start())")
        from megatron.core import parallel_state

        from .context_parallel import context_slice

        return context_slice(total, offsets, parallel_state.get_context_parallel_group())

    @property
    def ep_rank(self) -> int:
        """This process's expert-parallel rank: it holds experts ``[ep_rank x E/expert, (ep_rank + 1) x E/expert)``."""
        if not self.started:
            return 0
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_rank()

    def experts_held(self, num_experts: int, ep_rank: Optional[int] = None) -> Tuple[int, int]:
        """``[first, last)``: the routed experts this rank (or expert-parallel rank ``ep_rank``) holds of an MoE
        layer with ``num_experts`` (``experts_held``, the one rule)."""
        return experts_held(num_experts, self.expert, self.ep_rank if ep_rank is None else ep_rank)

    @property
    def expert_group(self):
        """The expert-parallel process group of this rank (megatron's); None before ``start``."""
        if not self.started:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_group()

    @property
    def expert_data_group(self):
        """The group holding the same experts as this rank (megatron's expert-data-parallel group); None
        before ``start``."""
        if not self.started:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_expert_data_parallel_group()

    def dense_mesh(self, device_type: str):
        """The one-dimensional ``DeviceMesh`` FSDP2 shards every parameter but the routed experts over: the
        data x context ranks (every rank: tensor parallelism is 1), in rank order. Made once (collective the
        first time)."""
        require(self.started, "parallel.sharding", "FSDP2's mesh needs the layout's groups started (start())")
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[device_type] = init_device_mesh(
                device_type, (self.gradient_ranks,), mesh_dim_names=("data_context",)
            )
        return self._meshes[device_type]

    # ---- the expert tags ----

    def tag_expert_parameters(self, model: nn.Module, zero3: bool) -> int:
        """The one rule for the expert parameters of a built model (adapters included); returns how many were
        tagged. With the groups started and ZeRO-3: each one marked ``allreduce = False`` is tagged to be
        partitioned within the expert-data-parallel group (module docstring). Under FSDP2 the marks stay as
        they are (the engine keeps the marked parameters out of its mesh and reduces their gradients within the
        expert-data-parallel group: ``training.engines.fsdp2``). Without expert parallelism and without the
        groups (the Hugging Face face on one process or data parallel), or without ZeRO-3 on one process: the
        marks are removed (``hide_expert_marks``). Expert parallelism without ZeRO-3 is refused by the
        DeepSpeed config check (``training.ds_config``) before this."""
        if self.sharding == "fsdp2":
            return 0
        if self.started and zero3:
            params = [p for p in model.parameters() if is_expert_parameter(p)]
            for p in params:
                tag_expert_parameter(p)
            return len(params)
        require(
            self.expert == 1,
            "parallel.expert_parallel_size",
            f"is {self.expert}, which needs ZeRO-3 (zero_optimization.stage 3) and the layout's groups started",
        )
        hide_expert_marks(model)
        return 0

    def stop(self) -> None:
        """Tear down megatron's parallel state (the default process group stays: whoever started it stops it)."""
        self._meshes.clear()
        if self.started:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            self.started = False
        if _STARTED and _STARTED[0] is self:
            _STARTED.clear()


def started_layout() -> Optional[ParallelLayout]:
    """The layout whose groups this process started, or None."""
    return _STARTED[0] if _STARTED and _STARTED[0].started else None


def hide_expert_marks(model: nn.Module) -> None:
    """Remove megatron's expert mark ``allreduce = False`` where no expert group partitions the experts
    (one process, or the Hugging Face face without expert parallelism): DeepSpeed's engine reads the mark as a
    DeepSpeed-MoE parameter and looks for a DeepSpeed-MoE expert group that such a model does not have. With
    every parameter replicated over the data-parallel group there is nothing the mark would change."""
    for p in model.parameters():
        if hasattr(p, "allreduce"):
            del p.allreduce


def _ranks(group) -> List[int]:
    return sorted(dist.get_process_group_ranks(group))
