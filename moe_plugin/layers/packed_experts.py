"""Routed experts kept packed as the checkpoint stores them (MXFP4 or INT4), dequantised on the fly
(docs/packed-experts.md).

``PackedStackedExperts`` is a ``StackedExperts`` whose ``w1``/``w3`` (``[E, F, L]`` logically) and ``w2``
(``[E, L, F]``) hold the packed codes, stacked per layer: ``w1`` ``[E, F, packed_cols(L)]`` beside ``w1_scale``
``[E, F, ceil(L/32)]`` (``ops.quant.formats`` gives the dtypes: MXFP4 uint8/uint8, INT4 int32 and the bf16
scale's uint8 bytes). They are frozen integer ``nn.Parameter`` s, so ZeRO-3 partitions them like any
parameter (within the expert-data-parallel group, through the expert tags) and no precision change
(``model.to(bf16)``, ``.half()``, DeepSpeed's bf16 engine, ``zero.Init``'s dtype) touches them: torch and
DeepSpeed convert floating-point tensors only.

The forward runs ``ops.quant.packed_grouped_linear`` for each projection, which dequantises one group of
``group_size`` experts at a time into the tokens' dtype, in forward and again in backward. LoRA adapters
arrive from ``moe_plugin.lora_packed.PackedParamWrapper`` (peft ``target_parameters`` on ``experts.w1``, ...)
through ``active_lora``: ``{kind: [(lora_A [E, r, in], lora_B [E, out, r], scaling), ...]}``, applied on the
activation side, never merged into a weight.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compat.deepspeed import full_numel
from ..ops.activations import glu
from ..ops.quant import DEFAULT_GROUP_SIZE, FORMATS, encode, grouped_lora, packed_grouped_linear, packed_spec
from .stacked_experts import _SEED_MIX, StackedExperts

__all__ = ["PackedStackedExperts", "KINDS"]

KINDS = ("w1", "w3", "w2")  # gate, up, down


class PackedStackedExperts(StackedExperts):
    """Packed ``experts`` (see the module docstring): ``forward(x_sorted [M, L], tokens_per_expert [E]) -> [M, L]``.

    expert_format: "mxfp4" or "int4". dtype: the dtype a preset's initial weights are drawn in before they are
    quantised (a checkpoint overwrites them); the compute dtype is the tokens'. seed / first_expert: as
    ``StackedExperts`` (each expert drawn from its own generator, so EP=n starts equal to EP=1).
    """

    is_packed = True

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        activation: str = "situ",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        seed: Optional[int] = None,
        first_expert: int = 0,
        expert_format: Optional[str] = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ):
        nn.Module.__init__(self)
        fmt = expert_format
        if fmt not in FORMATS:
            raise ValueError(f"MoEConfig.expert_format: PackedStackedExperts takes one of {FORMATS}, got {fmt!r}")
        if group_size < 1:
            raise ValueError(f"group_size: must be a positive number of experts, got {group_size}")
        self.expert_format, self.group_size = fmt, group_size
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.seed, self.first_expert = seed, first_expert
        self.init_dtype = dtype if dtype is not None and dtype.is_floating_point else torch.float32
        # logical [E, out, in] of each kind, what peft's adapters and the exports see
        self.logical_shapes: Dict[str, Tuple[int, int, int]] = {
            "w1": (num_experts, intermediate, dim),
            "w3": (num_experts, intermediate, dim),
            "w2": (num_experts, dim, intermediate),
        }
        for kind, (e, out, inp) in self.logical_shapes.items():
            spec = packed_spec(fmt, inp, f"experts.{kind}")
            self.register_parameter(
                kind,
                nn.Parameter(
                    torch.zeros(e, out, spec.packed_cols, dtype=spec.packed_dtype, device=device), requires_grad=False
                ),
            )
            self.register_parameter(
                f"{kind}_scale",
                nn.Parameter(
                    torch.zeros(e, out, spec.scale_cols, dtype=spec.scale_dtype, device=device), requires_grad=False
                ),
            )
        self.active_lora: Dict[str, List[tuple]] = {}
        self.reset_parameters()

    def packed_nbytes(self) -> int:
        """Bytes of the packed values and scales of every kind (full tensors, also when ZeRO-3 partitioned)."""
        total = 0
        for kind in KINDS:
            for t in (getattr(self, kind), getattr(self, f"{kind}_scale")):
                total += full_numel(t) * t.element_size()
        return total

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # StackedExperts' draws (nn.Linear's +-1/sqrt(fan_in) per expert), quantised: a packed preset starts as
        # the quantisation of the dense preset with the same seed
        if self.w1.is_meta or self.w1.numel() == 0:
            return
        if self.seed is None:  # torch's global generator, kind by kind over all experts
            for kind in KINDS:
                e, out, inp = self.logical_shapes[kind]
                self._store(kind, slice(None), self._draw((e, out, inp), None))
            return
        for j in range(self.w1.shape[0]):
            g = torch.Generator(device=self.w1.device)
            g.manual_seed((self.seed + (self.first_expert + j) * _SEED_MIX) % 2**63)
            for kind in KINDS:
                self._store(kind, j, self._draw(self.logical_shapes[kind][1:], g))

    def _draw(self, shape, generator) -> torch.Tensor:
        bound = 1.0 / math.sqrt(shape[-1])
        w = torch.empty(shape, dtype=self.init_dtype, device=self.w1.device)
        return w.uniform_(-bound, bound, generator=generator)

    def _store(self, kind: str, index, w: torch.Tensor) -> None:
        packed, scale = encode(self.expert_format, w.float(), scale_bits=True)
        getattr(self, kind)[index].copy_(packed)
        getattr(self, f"{kind}_scale")[index].copy_(scale)

    def _project(self, kind: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        y = packed_grouped_linear(
            x,
            counts,
            getattr(self, kind),
            getattr(self, f"{kind}_scale"),
            self.expert_format,
            self.logical_shapes[kind][2],
            self.group_size,
        )
        for lora_a, lora_b, scaling in self.active_lora.get(kind, ()):
            y = y + grouped_lora(x, counts, lora_a, lora_b, scaling)
        return y

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted: ``[M, L]`` rows grouped by expert; tokens_per_expert: ``[E]`` -> ``[M, L]`` in x's dtype."""
        # the counts as they come: the product reads them on the host once a tensor (ops.quant.experts)
        gate = self._project("w1", x_sorted, tokens_per_expert)
        up = self._project("w3", x_sorted, tokens_per_expert)
        h = glu(self.activation, gate, up, beta=self.situ_beta, linear_beta=self.situ_linear_beta)
        return self._project("w2", h, tokens_per_expert)

    def extra_repr(self) -> str:
        e, f, dim = self.logical_shapes["w1"]
        return (
            f"num_experts={e}, dim={dim}, intermediate={f}, activation={self.activation!r}, "
            f"expert_format={self.expert_format!r}, group_size={self.group_size}"
        )
