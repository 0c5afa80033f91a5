"""The planner's meta stand-ins (moe_plugin/plan/meta_ops.py): the GPU KDA kernel's saved set and working
tensors by hand, and the stand-in only where asked."""

from __future__ import annotations

import pytest
import torch

from moe_plugin.layers import kda as kda_layer
from moe_plugin.plan.saved_bytes import _run
from moe_plugin.plan.meta_ops import MetaDispatch, meta_forward

B, T, H, K, V = 1, 200, 2, 16, 32
BOUNDS = torch.tensor([0, 70, 200])  # two packed documents: 2 + 3 chunks of 64 tokens


def _inputs():
    q, k, g = (torch.empty(B, T, H, K, dtype=torch.bfloat16, device="meta").requires_grad_() for _ in range(3))
    v = torch.empty(B, T, H, V, dtype=torch.bfloat16, device="meta").requires_grad_()
    beta = torch.empty(B, T, H, dtype=torch.bfloat16, device="meta").requires_grad_()
    return q, k, v, g, beta


def test_gpu_kda_kernel_holds_what_fla_saves():
    q, k, v, g, beta = _inputs()
    working: list = []
    with meta_forward(MetaDispatch(1, 1.0, kernels="gpu")):
        saved = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda", working)
    two = 2  # bf16
    inputs = (3 * B * T * H * K + B * T * H * V + B * T * H) * two
    # fla 0.6's ChunkKDAFunction with recompute: its inputs, the fp32 chunk-local gate cumsum, Aqk and Akk
    assert saved["kda"] == inputs + B * T * H * K * 4 + 2 * B * T * H * 64 * two
    # made and dropped in the forward: the states of the 5 chunks, the WY factors w, u, the gated keys, the
    # new values, fp32 diagonal blocks
    states = 5 * H * K * V * two
    assert working[0] == states + (2 * B * T * H * K + 2 * B * T * H * V) * two + B * T * H * 16 * 4


def test_cpu_kernels_run_the_torch_path():
    q, k, v, g, beta = _inputs()
    with meta_forward(MetaDispatch(1, 1.0)):
        saved = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda")
    with meta_forward(MetaDispatch(1, 1.0, kernels="gpu")):
        gpu = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda")
    assert saved["kda"] > gpu["kda"]  # the torch path keeps its fp32 chunk tensors
    with pytest.raises(ValueError, match="kernels: must be 'cpu' or 'gpu'"):
        MetaDispatch(1, 1.0, kernels="tpu")
