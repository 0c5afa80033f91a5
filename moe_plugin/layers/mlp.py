"""The dense gated MLP: the first layer's MLP and the MoE layer's shared experts."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.activations import glu


class GLUMLP(nn.Module):
    """``down_proj(act(gate_proj(x), up_proj(x)))`` without biases, K3's ``mlp`` / ``shared_experts`` names.

    activation: "situ" (K3's SiTU-GLU with ``situ_beta``, ``situ_linear_beta``) or "swiglu".
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str = "situ",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
    ):
        super().__init__()
        # Fail at build time with the argument's name, not at the first forward.
        glu(activation, torch.zeros(1), torch.zeros(1))
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., hidden]`` -> ``[..., hidden]``."""
        h = glu(
            self.activation, self.gate_proj(x), self.up_proj(x), beta=self.situ_beta, linear_beta=self.situ_linear_beta
        )
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
