"""The interface every sharding engine implements (``training/engines/__init__.py`` says how the loop calls it)."""

from __future__ import annotations

import abc
from typing import Dict, Optional, Tuple

import torch
from torch import nn

__all__ = ["Engine", "adamw"]


def adamw(params, schedule) -> Tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The torch AdamW over ``params`` (weight-decay groups: ``step_math.parameter_groups``) and the recipe's
    learning-rate schedule, the same for every engine."""
    from ..schedule import lr_scheduler
    from ..step_math import parameter_groups

    optimizer = torch.optim.AdamW(parameter_groups(params, schedule.weight_decay), lr=schedule.lr)
    return optimizer, lr_scheduler(optimizer, schedule)


class Engine(abc.ABC):
    """One sharding engine wrapped around a built model (module docstring): ``Engine(model, recipe, layout,
    config, backend)``, the model as the backend built it (adapters on, base loaded), the run's started
    ``ParallelLayout``, ``config(recipe, world)`` and the backend (``shard_units``).

    Attributes after construction: ``module`` (the model; its parameters hold this rank's part), ``forward``
    (what a backend's ``loss`` calls: the model or a wrapper of it), ``optimizer`` and ``lr_scheduler``.
    ``config(recipe, world)`` is checked before any process group exists and passed to the backend's
    ``build_model`` and to the constructor."""

    name: str = ""
    module: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR

    @staticmethod
    @abc.abstractmethod
    def config(recipe, world: int) -> Optional[Dict]:
        """The engine's own configuration for ``recipe`` on ``world`` processes (ValueError naming the field when
        the recipe asks for what this engine cannot do)."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate ``loss``'s gradients, divided by the step's micro-batch count; reduced over the ranks only
        when ``last`` (the step's final micro-batch)."""

    @abc.abstractmethod
    def step(self, last: bool) -> Optional[float]:
        """After each micro-batch's backward; on the ``last``: clip by the global norm, step AdamW and the
        schedule, zero the gradients, and return that norm (before clipping)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """How this engine shards the model, for the run's first line."""

    @property
    @abc.abstractmethod
    def optimizer_steps(self) -> int:
        """The optimizer steps taken (restored ones included)."""

    @abc.abstractmethod
    def whole_fp32(self, p: nn.Parameter) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's whole (local-expert) fp32 value of trainable ``p`` and its AdamW moments, on the CPU
        (zeros before the first step); collective over the group that shards ``p``."""

    @abc.abstractmethod
    def set_whole(self, p: nn.Parameter, value: torch.Tensor, moments: Tuple[torch.Tensor, ...], step: int) -> None:
        """Write the whole (local-expert) ``value`` and AdamW ``moments`` of trainable ``p`` into this rank's part
        of it, its optimizer state at AdamW step ``step``."""

    # whether the engine writes files of its own beside the layout-free state (and loads them at the layout
    # and engine that wrote them)
    own_files: bool = False

    def save(self, directory: str, tag: str) -> None:
        """This engine's own files of a checkpoint, under ``directory/tag`` (none by default)."""
        return None

    def check_own_files(self, directory: str, tag: str, rank: int, world: int) -> None:
        """ValueError naming the first of this rank's own files of checkpoint ``directory`` that is damaged."""
        return None

    def load(self, directory: str, tag: str) -> None:
        """Load this engine's own files of checkpoint ``directory`` (where ``own_files``)."""
        raise NotImplementedError(f"the {self.name} engine resumes from the layout-free state only")

    def resumed_at(self, step: int, global_batch: int) -> None:
        """The layout-free state of step ``step`` was restored (``global_batch`` rows a step): the engine's own
        counters follow."""
        return None

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()
