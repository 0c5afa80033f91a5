"""Kimi Delta Attention layer (docs/architecture.md 2.1) with K3's parameter names, for one device.

q, k = l2norm(silu(conv(W_q x or W_k x))); v = silu(conv(W_v x)); beta = sigmoid(W_b x);
g = gate(W_f_b W_f_a x) per channel; o = KDA(q, k, v, g, beta); y = W_o(RMSNorm_head(o) * sigmoid(W_g x)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..config import KDAConfig
from ..ops.checks import check_tensor
from ..ops.context import ContextSlice
from ..ops.conv import causal_conv1d, causal_conv1d_context
from .attention_inputs import AttentionInputs, layer_inputs
from ..ops.kda import chunk_kda, kda_gate_k3, kda_gate_kimi_linear, l2norm, naive_recurrent_kda
from ..ops.kda.context_parallel import chunk_kda_context
from ..ops.offsets import host_offsets
from .norm import RMSNorm

LINEAR_INIT_STD = 0.02  # the projections' N(0, std) when the layer is built on its own


@dataclass
class KDACache:
    """Decoding state of one KDA layer; every field ``None`` while empty, the layer updates it in place.

    state: ``[B, H, K, V]`` recurrent state (fp32); q_conv, k_conv, v_conv: ``[B, H*K, W-1]`` the last W-1
    projected inputs of each short convolution.
    """

    state: Optional[torch.Tensor] = None
    q_conv: Optional[torch.Tensor] = None
    k_conv: Optional[torch.Tensor] = None
    v_conv: Optional[torch.Tensor] = None


class ShortConvolution(nn.Module):
    """Causal depthwise convolution with SiLU; ``weight`` ``[C, 1, W]`` as a depthwise nn.Conv1d stores it,
    so K3 checkpoints load unchanged."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Conv1d's default for a depthwise kernel: uniform in +-1/sqrt(kernel_size)."""
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        state: Optional[torch.Tensor] = None,
        output_final_state: bool = False,
        cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x ``[B, T, C]``, state ``[B, C, W-1]`` -> (``[B, T, C]``, new state ``[B, C, W-1]`` or None);
        cu_seqlens a tensor or host ints (``ops.conv.causal_conv1d``)."""
        return causal_conv1d(
            x,
            self.weight.squeeze(1),
            activation="silu",
            initial_state=state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )


class KDAAttention(nn.Module):
    def __init__(self, config: KDAConfig):
        super().__init__()
        self.config = config
        d, proj, heads = config.hidden_size, config.proj_size, config.num_heads
        self.q_proj = nn.Linear(d, proj, bias=False)
        self.k_proj = nn.Linear(d, proj, bias=False)
        self.v_proj = nn.Linear(d, proj, bias=False)
        self.q_conv1d = ShortConvolution(proj, config.conv_size)
        self.k_conv1d = ShortConvolution(proj, config.conv_size)
        self.v_conv1d = ShortConvolution(proj, config.conv_size)
        self.f_a_proj = nn.Linear(d, config.gate_rank, bias=False)
        self.f_b_proj = nn.Linear(config.gate_rank, proj, bias=False)
        self.b_proj = nn.Linear(d, heads, bias=False)
        self.g_proj = nn.Linear(d, proj, bias=False)
        # The decay parameters stay fp32 (small changes to them compound over the sequence) and, as fla marks
        # them, take no weight decay.
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(proj, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.o_norm = RMSNorm(config.head_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(proj, d, bias=False)
        for linear in (m for m in self.modules() if isinstance(m, nn.Linear)):
            nn.init.normal_(linear.weight, 0.0, LINEAR_INIT_STD)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The layer's own decay parameters (its submodules initialise theirs; __init__ draws the projections
        from N(0, LINEAR_INIT_STD)): A_log = log U(1, 16) (decay rates as in Mamba/fla); dt_bias = softplus^-1(dt), dt
        log-uniform in [1e-3, 1e-1]."""
        self.A_log.uniform_(1.0, 16.0).log_()
        dt = self.dt_bias.uniform_(math.log(1e-3), math.log(1e-1)).exp_()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[KDACache] = None,
        token_mask: Optional[torch.Tensor] = None,
        context: Optional[ContextSlice] = None,
        inputs: Optional[AttentionInputs] = None,
    ) -> torch.Tensor:
        """hidden_states ``[B, T, D]`` -> ``[B, T, D]``.

        cu_seqlens ``[N + 1]`` (batch 1): packed sequences, state and conv windows restart at each boundary.
        cache: read and updated in place, so a prefill followed by one-token steps equals one full pass;
        a one-token step runs the recurrence directly (O(1) in the context length).
        token_mask ``[B, T]`` bool, False = padding, which must come before a row's real tokens (left padding,
        with nothing cached for that row yet): padded tokens feed zeros into the convolutions (as the empty
        conv state does) and get beta = 0, g = 0 (no write, no decay), so the real tokens' outputs and the
        cache equal those of the unpadded row. The outputs at padded positions are meaningless.
        context: this rank's ``ContextSlice`` under context parallelism (docs/context-parallel.md):
        hidden_states is the rank's slice ``[B, context.length, D]`` of the row (B 1 when it packs several
        documents), cu_seqlens, cache and token_mask are None, and the output is the slice's part of the
        row's output. The convolutions' last W-1 inputs and the KDA state pass between the ranks.
        inputs: the forward's ``AttentionInputs`` (``layers.attention_inputs``), in place of cu_seqlens,
        token_mask and context.
        """
        cfg = self.config
        check_tensor("hidden_states", hidden_states, shape=(None, None, cfg.hidden_size), floating=True)
        inputs = layer_inputs(
            inputs, hidden_states, cache, cu_seqlens=cu_seqlens, token_mask=token_mask, context=context
        )
        cu_seqlens, context = inputs.cu_seqlens, inputs.context
        B, T, _ = hidden_states.shape
        real = None if inputs.token_mask is None else inputs.token_mask.unsqueeze(-1)  # [B, T, 1]
        heads = (B, T, cfg.num_heads, cfg.head_dim)
        keep = cache is not None
        x = hidden_states

        def conv_input(proj: nn.Linear) -> torch.Tensor:
            y = proj(x)
            return y if real is None else y.masked_fill(~real, 0.0)

        if context is not None:  # one exchange for the three convolutions' histories
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            qkv = causal_conv1d_context(
                torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1),
                torch.cat([conv.weight.squeeze(1) for conv in convs]),
                context,
            )
            q, k, v = qkv.split(cfg.proj_size, dim=-1)
        else:
            # host ints to the convolutions: a tensor argument of a submodule may reach it as a copy (ZeRO-3's
            # hooks), which would lose the host copy this layer's read keeps (ops/offsets.py)
            offsets = host_offsets(cu_seqlens)
            q, q_conv = self.q_conv1d(conv_input(self.q_proj), cache.q_conv if keep else None, keep, offsets)
            k, k_conv = self.k_conv1d(conv_input(self.k_proj), cache.k_conv if keep else None, keep, offsets)
            v, v_conv = self.v_conv1d(conv_input(self.v_proj), cache.v_conv if keep else None, keep, offsets)
        q, k, v = l2norm(q.view(heads)), l2norm(k.view(heads)), v.view(heads)
        beta = torch.sigmoid(self.b_proj(x))
        f = self.f_b_proj(self.f_a_proj(x)).view(heads)
        if cfg.gate_form == "k3":
            g, bound = kda_gate_k3(f, self.A_log, self.dt_bias, cfg.gate_lower_bound), cfg.gate_lower_bound
        else:
            g, bound = kda_gate_kimi_linear(f, self.A_log, self.dt_bias), None
        if real is not None:
            beta = beta.masked_fill(~real, 0.0)
            g = g.masked_fill(~real.unsqueeze(-1), 0.0)

        state = cache.state if keep else None
        if context is not None:
            o = chunk_kda_context(q, k, v, g, beta, context, chunk_size=cfg.chunk_size, gate_lower_bound=bound)
        elif keep and T == 1:
            o, state = naive_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
        else:
            o, state = chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=state,
                output_final_state=keep,
                cu_seqlens=cu_seqlens,
                chunk_size=cfg.chunk_size,
                gate_lower_bound=bound,
            )
        if keep:
            cache.state, cache.q_conv, cache.k_conv, cache.v_conv = state, q_conv, k_conv, v_conv

        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x)).view(heads)
        return self.o_proj(o.reshape(B, T, cfg.proj_size))
