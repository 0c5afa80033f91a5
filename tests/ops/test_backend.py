"""ops.backend's packed-experts entry: no package ships a fused MXFP4/INT4 dequant(-matmul) kernel usable here,
so even for CUDA tensors the choice is the torch decoder, nothing is imported for it, and dequantize_experts
decodes exactly as the plain reference does."""

from __future__ import annotations

import pytest
import torch

import moe_plugin.ops.backend as backend
from moe_plugin.ops.quant import decode, encode
from moe_plugin.ops.quant.experts import dequantize_experts


def test_packed_experts_take_the_torch_path_on_every_device(monkeypatch):
    imported = []
    monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)  # as if the tensors lived on a GPU
    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: imported.append(module))
    packed, scale = encode("mxfp4", torch.randn(2, 8, 64))
    for fmt in ("mxfp4", "int4"):
        assert backend.PACKED_DEQUANT_KERNELS[fmt] is None
        assert backend.packed_dequant_kernel(fmt, packed, scale) is None
    assert torch.equal(
        dequantize_experts("mxfp4", packed, scale, 64, torch.float32),
        decode("mxfp4", packed, scale, 64, reference=True),
    )
    assert imported == []  # no kernel module is looked for
    with pytest.raises(ValueError, match=r"^format: unknown packed format 'nvfp4'"):
        backend.packed_dequant_kernel("nvfp4", packed)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_sliced_decoding_equals_the_reference(monkeypatch, fmt):
    import moe_plugin.ops.quant.experts as experts

    monkeypatch.setattr(experts, "MIN_DECODE_CHUNK", 64)  # several row slices, the last one short
    packed, scale = encode(fmt, torch.randn(3, 7, 96), scale_bits=True)
    got = dequantize_experts(fmt, packed, scale, 96, torch.bfloat16)
    assert got.shape == (3, 7, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got, decode(fmt, packed, scale, 96, torch.bfloat16, reference=True))
