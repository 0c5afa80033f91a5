"""Kimi Delta Attention ops: the token-by-token reference, the chunked form (with fla's kernel on CUDA),
the decay gates and the L2 normalisation of q and k."""

from moe_plugin.ops.kda.chunk import chunk_kda
from moe_plugin.ops.kda.gate import kda_gate_k3, kda_gate_kimi_linear, l2norm
from moe_plugin.ops.kda.recurrent import naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda", "kda_gate_k3", "kda_gate_kimi_linear", "l2norm"]
