"""The two packed expert formats of the published checkpoints (docs/k3-formats.md), as pure functions.

Each format has a decoder (fast, vectorised) beside a plain reference that follows the published formula
element by element, and an encoder (used by the tiny-checkpoint generator and by requantising exports).

* ``mxfp4`` (compressed-tensors ``mxfp4-pack-quantized``, Kimi K3): ``packed`` uint8 ``[..., out, ceil(in/2)]``,
  byte j holding column 2j in its low nibble and 2j+1 in its high nibble as FP4 E2M1 codes; ``scale`` uint8
  ``[..., out, ceil(in/32)]``, an E8M0 exponent: ``W = LUT[code] * 2 ** (scale - 127)``.
* ``int4`` (compressed-tensors ``pack-quantized``, symmetric, Kimi K2 family): ``packed`` int32
  ``[..., out, ceil(in/8)]``, column j in bits ``4*(j%8)`` of word ``j//8`` as ``q + 8``; ``scale`` bf16
  ``[..., out, ceil(in/32)]``: ``W = (code - 8) * scale``. A layer keeps the bf16 scale's bytes as uint8
  (``scale.view(torch.uint8)``, ``[..., out, 2 * ceil(in/32)]``) so that no precision conversion
  (``model.to(dtype)``, a bf16 engine) ever touches it, and gloo can gather it (it has no int16); the
  decoders take either.

Scale byte 0xFF is NaN in the OCP MX specification; the decoders refuse it (``check_packed``) rather than
produce a silent 2**128.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["FORMATS", "GROUP", "PackedSpec", "packed_spec", "check_packed", "decode_mxfp4", "decode_mxfp4_reference",
           "encode_mxfp4", "decode_int4", "decode_int4_reference", "encode_int4", "decode", "encode", "E2M1"]

FORMATS = ("mxfp4", "int4")
GROUP = 32  # inputs sharing one scale, both formats
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_NAN_SCALE = 0xFF


@dataclass(frozen=True)
class PackedSpec:
    """Storage of one ``[out, in]`` weight in ``format``: packed ``[out, packed_cols]`` of ``packed_dtype``,
    scale ``[out, scale_cols]`` of ``scale_dtype`` (as a layer keeps it: the int4 bf16 scale as its uint8 bytes,
    two a group)."""

    format: str
    packed_cols: int
    packed_dtype: torch.dtype
    scale_cols: int
    scale_dtype: torch.dtype

    def nbytes(self, out: int) -> int:
        return out * (self.packed_cols * self.packed_dtype.itemsize + self.scale_cols * self.scale_dtype.itemsize)


def packed_spec(fmt: str, in_features: int, name: str = "format") -> PackedSpec:
    """The ``PackedSpec`` of a weight with ``in_features`` columns; ValueError naming ``name`` for an unknown
    format or an odd MXFP4 width (two codes a byte, as compressed-tensors requires)."""
    if fmt == "mxfp4":
        if in_features % 2:
            raise ValueError(f"{name}: MXFP4 packs two columns a byte, so the input width must be even, "
                             f"got {in_features}")
        return PackedSpec(fmt, in_features // 2, torch.uint8, -(-in_features // GROUP), torch.uint8)
    if fmt == "int4":
        return PackedSpec(fmt, -(-in_features // 8), torch.int32, 2 * -(-in_features // GROUP), torch.uint8)
    raise ValueError(f"{name}: unknown packed format {fmt!r}; expected one of {FORMATS}")


def check_packed(name: str, fmt: str, packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                 values: bool = True) -> None:
    """ValueError naming ``name`` (e.g. the checkpoint tensor) unless ``packed``/``scale`` are a ``fmt`` weight
    of ``in_features`` columns; ``values``: also refuse the NaN scale byte 0xFF of MXFP4."""
    spec = packed_spec(fmt, in_features, name)
    if packed.dtype != spec.packed_dtype:
        raise ValueError(f"{name}: {fmt} packed values must be {spec.packed_dtype}, got {packed.dtype}")
    if scale.dtype not in (spec.scale_dtype, torch.bfloat16 if fmt == "int4" else torch.uint8):
        raise ValueError(f"{name}: {fmt} scales must be {spec.scale_dtype}, got {scale.dtype}")
    if scale.dtype == torch.bfloat16:
        spec = PackedSpec(fmt, spec.packed_cols, spec.packed_dtype, spec.scale_cols // 2, torch.bfloat16)
    if packed.shape[-1] != spec.packed_cols:
        raise ValueError(f"{name}: {fmt} packed values of {in_features} columns must be [..., out, "
                         f"{spec.packed_cols}], got {list(packed.shape)}")
    if tuple(scale.shape) != (*packed.shape[:-1], spec.scale_cols):
        raise ValueError(f"{name}: {fmt} scales must be [{', '.join(map(str, packed.shape[:-1]))}, "
                         f"{spec.scale_cols}] (one per {GROUP} inputs), got {list(scale.shape)}")
    if values and fmt == "mxfp4" and scale.numel() and bool((scale == _NAN_SCALE).any()):
        where = (scale == _NAN_SCALE).nonzero()[0].tolist()
        raise ValueError(f"{name}: scale byte 0xFF (NaN in the MX specification) at index {where}; the "
                         "checkpoint is damaged or not MXFP4")


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    # ldexp of 1 by (s - 127) is exact in fp32 for every s in [0, 254], 2**-127 being a subnormal
    return torch.ldexp(torch.ones(scale.shape, dtype=torch.float32, device=scale.device), scale.to(torch.int32) - 127)


def _expand_groups(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    return scale.repeat_interleave(GROUP, dim=-1)[..., :in_features]


def _pair_lut(values, device) -> torch.Tensor:
    """``[256, 2]`` fp32: byte b -> (value of its low nibble, value of its high nibble); one gather per byte."""
    lut = torch.tensor(values, dtype=torch.float32, device=device)
    b = torch.arange(256, device=device)
    return torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)


def _apply_scale(w: torch.Tensor, s: torch.Tensor, in_features: int) -> torch.Tensor:
    """``w [..., >= in]`` fp32 times ``s [..., groups]`` fp32 per group of 32 inputs, in place where the width is
    whole groups (no expanded copy of the scales); -> ``[..., in]``."""
    groups = s.shape[-1]
    if w.shape[-1] == groups * GROUP:
        w.view(*w.shape[:-1], groups, GROUP).mul_(s.unsqueeze(-1))
        return w[..., :in_features]
    return w[..., :in_features] * _expand_groups(s, in_features)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 packed ``[..., out, in/2]``, uint8 scale ``[..., out, ceil(in/32)]`` -> ``[..., out, in]`` dtype.

    Decoded in fp32 (where every E2M1 value times a power of two is exact) and then cast once to ``dtype``:
    one gather of both nibbles a byte, then the scales applied in place."""
    w = _pair_lut(E2M1, packed.device)[packed.long()].view(*packed.shape[:-1], -1)
    return _apply_scale(w, _pow2(scale), in_features).to(dtype)


def decode_mxfp4_reference(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The published formula, column by column: ``W[o, j] = LUT[nibble(j)] * 2 ** (scale[o, j // 32] - 127)``."""
    out = torch.empty(*packed.shape[:-1], in_features, dtype=torch.float64)
    p, s = packed.to(torch.int64), scale.to(torch.int64)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    for j in range(in_features):
        nibble = (p[..., j // 2] >> (4 * (j % 2))) & 0xF
        out[..., j] = lut[nibble] * torch.pow(2.0, (s[..., j // GROUP] - 127).to(torch.float64))
    return out.to(dtype)


def encode_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` float -> (packed uint8, scale uint8): per group the OCP MX scale
    ``2 ** (floor(log2(amax)) - 2)`` (E2M1's largest exponent is 2), codes rounded to the nearest E2M1 value
    (ties to the even code), values beyond 6 x scale saturating."""
    in_features = w.shape[-1]
    packed_spec("mxfp4", in_features, "w")
    groups = -(-in_features // GROUP)
    x = torch.nn.functional.pad(w.float(), (0, groups * GROUP - in_features)).view(*w.shape[:-1], groups, GROUP)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -127))) - 2,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    y = x / torch.ldexp(torch.ones_like(exp), exp.to(torch.int32)).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1[:8])
    # nearest magnitude; argmin takes the first (the even code) on a tie
    idx = (y.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (idx | (torch.signbit(y).to(torch.int64) << 3)).flatten(-2)[..., :in_features].to(torch.uint8)
    codes = codes.view(*codes.shape[:-1], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous(), scale


def _bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.contiguous().view(torch.bfloat16) if scale.dtype == torch.uint8 else scale.to(torch.bfloat16)


def decode_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 packed ``[..., out, ceil(in/8)]``, scale ``[..., out, ceil(in/32)]`` bf16 (or its uint8 bytes)
    -> ``[..., out, in]`` dtype; the product ``(code - 8) * scale`` is computed in fp32 (exact)."""
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian: word byte b holds columns 2b, 2b + 1
    q = _pair_lut(tuple(float(c - 8) for c in range(16)), packed.device)[nibbles.long()]
    w = q.view(*packed.shape[:-1], -1)
    return _apply_scale(w, _bf16_scale(scale).float(), in_features).to(dtype)


def decode_int4_reference(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The published formula: ``q = ((packed[o, j // 8] >> 4 * (j % 8)) & 0xF) - 8``; ``W = q * scale[o, j // 32]``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    s = _bf16_scale(scale).to(torch.float64)
    out = torch.empty(*packed.shape[:-1], in_features, dtype=torch.float64)
    for j in range(in_features):
        q = ((p[..., j // 8] >> (4 * (j % 8))) & 0xF) - 8
        out[..., j] = q.to(torch.float64) * s[..., j // GROUP]
    return out.to(dtype)


def encode_int4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` float -> (packed int32, scale bf16): symmetric, ``scale = amax / 7`` per group (in bf16),
    ``q = clamp(round(w / scale), -8, 7)``."""
    in_features = w.shape[-1]
    groups = -(-in_features // GROUP)
    x = torch.nn.functional.pad(w.float(), (0, groups * GROUP - in_features)).view(*w.shape[:-1], groups, GROUP)
    scale = (x.abs().amax(-1) / 7).to(torch.bfloat16)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
    q = torch.clamp(torch.round(x / safe.unsqueeze(-1)), -8, 7).flatten(-2)[..., :in_features].to(torch.int64) + 8
    words = -(-in_features // 8)
    q = torch.nn.functional.pad(q, (0, words * 8 - in_features), value=8).view(*w.shape[:-1], words, 8)
    packed = (q << (4 * torch.arange(8))).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed, scale


def decode(fmt: str, packed: torch.Tensor, scale: torch.Tensor, in_features: int,
           dtype: torch.dtype = torch.float32, reference: bool = False) -> torch.Tensor:
    """Decode a ``fmt`` weight (see the module docstring) to ``[..., out, in]`` of ``dtype``."""
    packed_spec(fmt, in_features)
    if fmt == "mxfp4":
        return (decode_mxfp4_reference if reference else decode_mxfp4)(packed, scale, in_features, dtype)
    return (decode_int4_reference if reference else decode_int4)(packed, scale, in_features, dtype)


def encode(fmt: str, w: torch.Tensor, scale_bits: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., out, in]`` to ``fmt``; ``scale_bits``: the int4 scale as its uint8 bytes (a layer's storage)."""
    packed_spec(fmt, w.shape[-1], "w")
    if fmt == "mxfp4":
        return encode_mxfp4(w)
    packed, scale = encode_int4(w)
    return packed, (scale.view(torch.uint8) if scale_bits else scale)


def nbytes(fmt: str, out: int, in_features: int, experts: Optional[int] = 1) -> int:
    """Bytes of ``experts`` packed ``[out, in]`` weights with their scales."""
    return (experts or 1) * packed_spec(fmt, in_features).nbytes(out)
