"""DeepSpeed's engine behind the loop (``parallel.sharding: "zero3"``, the default): ZeRO-3 partitions every
parameter within the groups ``parallel.layout`` tags (routed experts within their expert-data-parallel group,
the rest over every rank; docs/zero3-ep.md), reduces and clips the gradients with one norm on every rank and
steps a torch AdamW. One process without expert parallelism runs the same engine at ZeRO stage 0.

Its checkpoint files (``engine/``: the adapters or trainable parameters, optimizer shards, scheduler) load with
``weights_only=True`` after a check of every file (``compat/deepspeed.py``), at the layout that wrote them."""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ...compat.deepspeed import adam_states, check_engine_files, safe_checkpoint_loading
from ..ds_config import deepspeed_config, zero_stage
from ..step_math import local_grad_norm
from ..trainable_state import MOMENTS
from .base import Engine, adamw

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(Engine):
    """``deepspeed.initialize`` over the built ``model`` with the run's DeepSpeed ``ds_config``
    (``config``: ``training.ds_config.deepspeed_config``)."""

    name = "zero3"
    own_files = True

    def __init__(self, model: nn.Module, recipe, layout, ds_config: Dict, backend=None):
        import deepspeed

        optimizer, scheduler = adamw([p for p in model.parameters() if p.requires_grad], recipe.schedule)
        self.ds_config, self.zero3 = ds_config, zero_stage(ds_config) == 3
        self.forward, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
        )
        self.module = self.forward.module

    @staticmethod
    def config(recipe, world: int) -> Dict:
        return deepspeed_config(recipe, world)

    def describe(self) -> str:
        return f"ZeRO stage {zero_stage(self.ds_config)}"

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.forward.backward(loss)  # the engine counts the micro-batches: it divides and reduces itself

    def step(self, last: bool) -> Optional[float]:
        norm = None
        if last and not self.zero3:  # the engine reports a norm only under ZeRO; one process: the local grads
            norm = local_grad_norm(self.module)
        self.forward.step()  # every micro-batch: the engine steps at its accumulation boundary
        if last and self.zero3:
            norm = self.forward.get_global_grad_norm()
        return float(norm) if norm is not None else None

    @property
    def optimizer_steps(self) -> int:
        return int(self.forward.global_steps)

    def whole_fp32(self, p: nn.Parameter) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        value = safe_get_full_fp32_param(p)
        if value is not None:  # ZeRO (any stage) or DeepSpeed's bf16 optimizer: its fp32 master and moments
            return (value.detach().float().cpu(),) + tuple(
                safe_get_full_optimizer_state(p, key).detach().float().cpu() for key in MOMENTS
            )
        state = adam_states(self.optimizer).get(p, {})  # a plain torch AdamW (one process, fp32)
        zeros = torch.zeros(p.shape, dtype=torch.float32)
        return (p.detach().float().cpu(),) + tuple(
            state[k].detach().float().cpu() if k in state else zeros for k in MOMENTS
        )

    @torch.no_grad()
    def set_whole(self, p: nn.Parameter, value: torch.Tensor, moments: Tuple[torch.Tensor, ...], step: int) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from ...weights.loader import write_flat

        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # ZeRO-3, or ZeRO-1/2 and DeepSpeed's bf16 optimizer
            safe_set_full_fp32_param(p, value.to(p.device))
            for key, m in zip(MOMENTS, moments):
                safe_set_full_optimizer_state(p, m.to(p.device), key)
            write_flat(p, 0, value)  # the low-precision copy the forward reads (this rank's partition under ZeRO-3)
            return
        p.data.copy_(value.view(p.shape))
        adam_states(self.optimizer)[p] = {
            "step": torch.tensor(float(step)),
            **{k: m.view(p.shape).to(p.device).clone() for k, m in zip(MOMENTS, moments)},
        }

    def save(self, directory: str, tag: str) -> None:
        self.forward.save_checkpoint(directory, tag=tag, exclude_frozen_parameters=True, save_latest=False)

    def check_own_files(self, directory: str, tag: str, rank: int, world: int) -> None:
        """ValueError naming the first of this rank's share of the engine files that does not load safely."""
        check_engine_files(os.path.join(directory, tag), rank, world)

    def load(self, directory: str, tag: str) -> None:
        with safe_checkpoint_loading():
            self.forward.load_checkpoint(
                directory,
                tag=tag,
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )

    def resumed_at(self, step: int, global_batch: int) -> None:
        self.forward.global_steps, self.forward.micro_steps = step, step * self.forward.gradient_accumulation_steps()
        self.forward.global_samples = step * global_batch

    def train(self) -> None:
        self.forward.train()

    def eval(self) -> None:
        self.forward.eval()
