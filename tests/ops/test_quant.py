"""Packed expert formats: the decoders equal compressed-tensors' own unpacking of the same bytes exactly
(MXFP4 and INT4: every scale exponent, both nibbles, widths that are not multiples of the group), the fast
decoders equal the plain references, the grouped packed product and its input gradient equal the dequantised
fp32 experts, and bad inputs name the tensor."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

from moe_plugin.ops.quant import (
    check_packed,
    decode,
    decode_int4,
    decode_int4_reference,
    decode_mxfp4,
    decode_mxfp4_reference,
    encode,
    grouped_lora,
    grouped_lora_reference,
    packed_grouped_linear,
    packed_grouped_linear_reference,
)

WIDTHS = [64, 48, 10, 2]  # multiples of the group of 32, and not


def _ct_mxfp4(packed, scale, n):
    m = packed.shape[0]
    return (
        unpack_fp4_from_uint8(packed, m, n, torch.float32)
        * decompress_mx_scale(scale).float().repeat_interleave(32, 1)[:, :n]
    )


@pytest.mark.parametrize("n", WIDTHS)
def test_mxfp4_decoding_equals_compressed_tensors_exactly(n):
    g = torch.Generator().manual_seed(n)
    rows = 255  # every exponent 0..254 appears as a scale (0xFF is refused, see below)
    packed = torch.randint(0, 256, (rows, n // 2), dtype=torch.uint8, generator=g)
    scale = (torch.arange(rows * (-(-n // 32))) % 255).to(torch.uint8).view(rows, -1)
    ours = decode_mxfp4(packed, scale, n)
    assert torch.equal(ours, _ct_mxfp4(packed, scale, n))
    assert torch.equal(ours, decode_mxfp4_reference(packed, scale, n))
    # both nibbles: in byte 0x1F the low nibble (0xF = -6) is column 0, the high one (0x1 = 0.5) column 1
    one = decode_mxfp4(torch.tensor([[0x1F]], dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8), 2)
    assert one.tolist() == [[-6.0, 0.5]]


@pytest.mark.parametrize("n", WIDTHS + [7, 33])
def test_int4_decoding_equals_compressed_tensors_exactly(n):
    g = torch.Generator().manual_seed(n)
    packed = torch.randint(-(2**31), 2**31 - 1, (9, -(-n // 8)), dtype=torch.int32, generator=g)
    scale = torch.randn(9, -(-n // 32), generator=g).to(torch.bfloat16)
    ours = decode_int4(packed, scale, n)
    ref = unpack_from_int32(packed, 4, torch.Size((9, n))).float() * scale.float().repeat_interleave(32, 1)[:, :n]
    assert torch.equal(ours, ref)
    assert torch.equal(ours, decode_int4_reference(packed, scale, n))
    assert torch.equal(decode_int4(packed, scale.view(torch.uint8), n), ours)  # a layer keeps the bytes as uint8


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_encoding_is_a_fixed_point_of_decoding(fmt):
    w = torch.randn(3, 16, 48, generator=torch.Generator().manual_seed(0))
    packed, scale = encode(fmt, w)
    again = encode(fmt, decode(fmt, packed, scale, 48))
    assert torch.equal(decode(fmt, *again, 48), decode(fmt, packed, scale, 48))
    assert float((decode(fmt, packed, scale, 48) - w).abs().max()) < 0.5 * float(w.abs().max())


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_grouped_packed_linear_and_its_gradient_equal_the_dequantized_experts(fmt, group_size):
    g = torch.Generator().manual_seed(1)
    e, out, inp = 5, 16, 48
    packed, scale = encode(fmt, torch.randn(e, out, inp, generator=g), scale_bits=True)
    counts = torch.tensor([3, 0, 7, 1, 5])
    x = torch.randn(int(counts.sum()), inp, generator=g, requires_grad=True)
    y = packed_grouped_linear(x, counts, packed, scale, fmt, inp, group_size)
    x2 = x.detach().clone().requires_grad_(True)
    ref = packed_grouped_linear_reference(x2, counts, packed, scale, fmt, inp)
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    ref.backward(gy)
    assert float((x.grad - x2.grad).abs().max()) <= 1e-5 * float(x2.grad.abs().max())


def test_nothing_dequantized_is_saved_for_backward():
    g = torch.Generator().manual_seed(2)
    e, out, inp = 4, 16, 32
    packed, scale = encode("mxfp4", torch.randn(e, out, inp, generator=g))
    counts = torch.tensor([2, 3, 1, 4])
    x = torch.randn(10, inp, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        packed_grouped_linear(x, counts, packed, scale, "mxfp4", inp, group_size=2).sum().backward()
    floats = [t for t in saved if t.is_floating_point()]
    assert not any(t.numel() >= out * inp for t in floats), [tuple(t.shape) for t in floats]
    assert any(t.data_ptr() == packed.data_ptr() for t in saved)  # the stored bytes themselves


def test_grouped_lora_equals_the_loop():
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([2, 0, 5])
    x = torch.randn(7, 32, generator=g)
    a, b = torch.randn(3, 4, 32, generator=g), torch.randn(3, 16, 4, generator=g)
    assert torch.allclose(
        grouped_lora(x, counts, a, b, 2.0), grouped_lora_reference(x, counts, a, b, 2.0), rtol=1e-5, atol=1e-6
    )


def test_bad_packed_inputs_name_the_tensor():
    p, s = encode("mxfp4", torch.randn(4, 64))
    check_packed("layers.1.experts.0.w1", "mxfp4", p, s, 64)
    with pytest.raises(ValueError, match=r"^layers\.1\.experts\.0\.w1: mxfp4 packed values of 64 columns"):
        check_packed("layers.1.experts.0.w1", "mxfp4", p[:, :16], s, 64)
    with pytest.raises(ValueError, match=r"^layers\.1\.experts\.0\.w1: mxfp4 scales must be \[4, 2\]"):
        check_packed("layers.1.experts.0.w1", "mxfp4", p, s[:, :1], 64)
    bad = s.clone()
    bad[2, 1] = 0xFF
    with pytest.raises(ValueError, match=r"^w: scale byte 0xFF .* at index \[2, 1\]"):
        check_packed("w", "mxfp4", p, bad, 64)
    with pytest.raises(ValueError, match=r"^experts\.w1: unknown packed format 'nvfp4'"):
        check_packed("experts.w1", "nvfp4", p, s, 64)
    with pytest.raises(ValueError, match=r"^w: MXFP4 packs two columns a byte"):
        encode("mxfp4", torch.randn(2, 7))
