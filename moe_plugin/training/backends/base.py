"""The seam between the training loop and a model face: build, parallelize, forward, export.

The loop (``moe_plugin.training.loop``) knows no backend's internals. A backend:

* ``setup_parallel()``: starts the groups of the run's ``ParallelLayout`` that this face needs
  (torch.distributed is already up) and returns the layout, which says which data-parallel rank this process
  is and how many there are: each data-parallel rank reads its own batches;
* ``build_model(ds_config)``: the model with its base weights and adapters, already partitioned by ZeRO-3
  when the DeepSpeed config asks for stage 3 (built under ``deepspeed.zero.Init``, so no rank ever holds a
  whole tensor it does not own); ``ds_config`` is None under FSDP2 (the engine shards the built model);
* ``loss(module, micro_batch, num_items)``: the forward of one micro-batch and its loss, the sum of its
  token losses divided by ``num_items`` (the loop passes the step's global label-token count over the
  data-parallel and accumulation factors, so the engine's averaging makes the step's gradient the gradient
  of the global token mean), plus any auxiliary losses, and a dict of detached metrics;
* ``moe_layers(module)``: the MoE layers whose expert loads the loop sums for balancing and logging;
* ``shard_units(module)``: the modules an FSDP2 engine shards one by one (the decoder layers; the root
  takes the rest);
* ``adapter_state(module)``: the full adapter tensors under Hugging Face PEFT names (gathered across
  expert-parallel and ZeRO ranks; collective), for the PEFT adapter the run writes at the end.
"""

from __future__ import annotations

import abc
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["Backend"]


class Backend(abc.ABC):
    """One model face (see the module docstring). ``recipe`` is the validated recipe, ``resolved`` its
    ``ResolvedModel`` (``recipe/resolved_model.py``: path, configs, tokenizer), ``device`` the torch device
    the model computes on, ``layout`` the run's ``ParallelLayout`` (built from the recipe, groups not started:
    ``setup_parallel`` starts what this face needs)."""

    name: str = ""

    def __init__(self, recipe, resolved, device: torch.device, layout):
        self.recipe, self.resolved, self.device, self.layout = recipe, resolved, device, layout
        self.model_config = resolved.model_config

    @abc.abstractmethod
    def setup_parallel(self):  # -> ParallelLayout, its groups started as this face needs them
        ...

    @abc.abstractmethod
    def build_model(self, ds_config: Optional[dict]) -> nn.Module: ...

    @abc.abstractmethod
    def loss(
        self, module: nn.Module, micro_batch, num_items: float
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def moe_layers(self, module: nn.Module) -> List[nn.Module]: ...

    @abc.abstractmethod
    def adapter_state(self, module: nn.Module) -> Dict[str, torch.Tensor]: ...

    def shard_units(self, module: nn.Module) -> List[nn.Module]:
        """The modules FSDP2 shards one by one (none by default: the root alone)."""
        return []

    def teardown(self) -> None:
        """Undo ``setup_parallel`` (the loop destroys the default process group itself)."""
        return None  # optional to override, so not abstract: by default there is nothing to undo

    @property
    def base_path(self) -> Optional[str]:
        """The base checkpoint directory the adapter applies to (None for a preset built from the seed)."""
        return self.resolved.path
