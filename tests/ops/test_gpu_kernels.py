"""The GPU kernels on CUDA against the plain references beside them (marked ``gpu``: skipped with the reason on
the CPU; ``benchmarks/gpu_check.py`` runs them first on a lent GPU). The CPU checks of the same kernels are
tests/ops/test_dsa_triton.py (Triton's interpreter) and tests/ops/test_kda.py (the torch paths)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

B, T, S, H, DQK, DV, TOPK = 2, 256, 256, 4, 64, 32, 48
FP32_TOL = 2e-6  # max error / max(1, max |ref|), as the interpreter checks hold the same kernels to


def _err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / max(1.0, float(ref.abs().max())))


def test_dsa_sparse_attention_triton_pair_equals_the_reference_on_cuda():
    from moe_plugin.ops import backend
    from moe_plugin.ops.dsa import sparse_op
    from moe_plugin.ops.dsa import sparse_triton as st
    from moe_plugin.ops.dsa.attention import sparse_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, n, H, DQK, device="cuda", generator=g) for n in (T, S))
    v = torch.randn(B, S, H, DV, device="cuda", generator=g)
    idx = torch.stack([torch.randperm(S, device="cuda", generator=g)[:TOPK] for _ in range(B * T)]).view(B, T, TOPK)
    idx = torch.where(torch.rand(B, T, TOPK, device="cuda", generator=g) < 0.25, -1, idx)
    grad_out = torch.randn(B, T, H, DV, device="cuda", generator=g)
    assert backend.gpu_kernel(sparse_op._TRITON, "sparse_attention_triton", q) is not None  # the op's choice
    scale = DQK**-0.5
    out, lse = st.sparse_attention_triton(q, k, v, idx, scale)
    grads = st.sparse_attention_triton_backward(grad_out, q, k, v, idx, out, lse, scale)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = sparse_attention_reference(*leaves, idx, scale)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    assert _err(out, ref) < FP32_TOL
    for name, mine, theirs in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(mine, theirs) < FP32_TOL, name


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention (the gpu extra) absent")
def test_kda_chunk_kernel_equals_the_torch_chunk_path_on_cuda(monkeypatch):
    from moe_plugin.ops.kda import chunk_kda, kda_gate_k3, l2norm

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 1024, 4, 64)
    q, k = (l2norm(torch.randn(*shape, device="cuda", generator=g)) for _ in range(2))
    v = torch.randn(*shape, device="cuda", generator=g)
    gate = kda_gate_k3(
        torch.randn(*shape, device="cuda", generator=g), torch.zeros(4, device="cuda"), torch.zeros(256, device="cuda")
    )
    beta = torch.rand(*shape[:3], device="cuda", generator=g)
    kernel, _ = chunk_kda(q, k, v, gate, beta)
    monkeypatch.setenv("MOE_PLUGIN_DISABLE_KERNELS", "1")
    torch_path, _ = chunk_kda(q, k, v, gate, beta)
    assert _err(kernel, torch_path) < 1e-4  # fla's chunked fp32 accumulation order differs from the torch path's
