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

__all__ = [
    "FORMATS",
    "GROUP",
    "PackedSpec",
    "packed_spec",
    "check_packed",
    "decode_mxfp4",
    "decode_mxfp4_reference",
    "encode_mxfp4",
    "decode_int4",
    "decode_int4_reference",
    "encode_int4",
    "decode",
    "encode",
    "E2M1",
    "INT4_VALUES",
    "groups",
    "stored_scales",
    "scale_values",
    "group_scales",
    "grid_codes",
    "round_to_grid",
    "round_to_grid_reference",
]

FORMATS = ("mxfp4", "int4")
GROUP = 32  # inputs sharing one scale, both formats
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
INT4_VALUES = tuple(float(c - 8) for c in range(16))  # code c holds q = c - 8
_CODE_VALUES = {"mxfp4": E2M1, "int4": INT4_VALUES}
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
            raise ValueError(
                f"{name}: MXFP4 packs two columns a byte, so the input width must be even, got {in_features}"
            )
        return PackedSpec(fmt, in_features // 2, torch.uint8, -(-in_features // GROUP), torch.uint8)
    if fmt == "int4":
        return PackedSpec(fmt, -(-in_features // 8), torch.int32, 2 * -(-in_features // GROUP), torch.uint8)
    raise ValueError(f"{name}: unknown packed format {fmt!r}; expected one of {FORMATS}")


def check_packed(
    name: str, fmt: str, packed: torch.Tensor, scale: torch.Tensor, in_features: int, values: bool = True
) -> None:
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
        raise ValueError(
            f"{name}: {fmt} packed values of {in_features} columns must be [..., out, "
            f"{spec.packed_cols}], got {list(packed.shape)}"
        )
    if tuple(scale.shape) != (*packed.shape[:-1], spec.scale_cols):
        raise ValueError(
            f"{name}: {fmt} scales must be [{', '.join(map(str, packed.shape[:-1]))}, "
            f"{spec.scale_cols}] (one per {GROUP} inputs), got {list(scale.shape)}"
        )
    if values and fmt == "mxfp4" and scale.numel() and bool((scale == _NAN_SCALE).any()):
        where = (scale == _NAN_SCALE).nonzero()[0].tolist()
        raise ValueError(
            f"{name}: scale byte 0xFF (NaN in the MX specification) at index {where}; the "
            "checkpoint is damaged or not MXFP4"
        )


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


def decode_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 packed ``[..., out, in/2]``, uint8 scale ``[..., out, ceil(in/32)]`` -> ``[..., out, in]`` dtype.

    Decoded in fp32 (where every E2M1 value times a power of two is exact) and then cast once to ``dtype``:
    one gather of both nibbles a byte, then the scales applied in place."""
    w = _pair_lut(E2M1, packed.device)[packed.long()].view(*packed.shape[:-1], -1)
    return _apply_scale(w, _pow2(scale), in_features).to(dtype)


def decode_mxfp4_reference(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The published formula, column by column: ``W[o, j] = LUT[nibble(j)] * 2 ** (scale[o, j // 32] - 127)``."""
    out = torch.empty(*packed.shape[:-1], in_features, dtype=torch.float64)
    p, s = packed.to(torch.int64), scale.to(torch.int64)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    for j in range(in_features):
        nibble = (p[..., j // 2] >> (4 * (j % 2))) & 0xF
        out[..., j] = lut[nibble] * torch.pow(2.0, (s[..., j // GROUP] - 127).to(torch.float64))
    return out.to(dtype)


def encode_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` float -> (packed uint8 ``[..., out, in/2]``, scale uint8 ``[..., out, ceil(in/32)]``): per
    group the scale ``stored_scales`` picks, codes ``grid_codes`` (see there)."""
    in_features = w.shape[-1]
    packed_spec("mxfp4", in_features, "w")
    x = groups(w.float())
    scale = stored_scales("mxfp4", x.abs().amax(-1))
    codes = grid_codes("mxfp4", x, scale_values("mxfp4", scale)).flatten(-2)[..., :in_features].to(torch.uint8)
    codes = codes.view(*codes.shape[:-1], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous(), scale


def _bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.contiguous().view(torch.bfloat16) if scale.dtype == torch.uint8 else scale.to(torch.bfloat16)


def decode_int4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """int32 packed ``[..., out, ceil(in/8)]``, scale ``[..., out, ceil(in/32)]`` bf16 (or its uint8 bytes)
    -> ``[..., out, in]`` dtype; the product ``(code - 8) * scale`` is computed in fp32 (exact)."""
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian: word byte b holds columns 2b, 2b + 1
    q = _pair_lut(INT4_VALUES, packed.device)[nibbles.long()]
    w = q.view(*packed.shape[:-1], -1)
    return _apply_scale(w, _bf16_scale(scale).float(), in_features).to(dtype)


def decode_int4_reference(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The published formula: ``q = ((packed[o, j // 8] >> 4 * (j % 8)) & 0xF) - 8``; ``W = q * scale[o, j // 32]``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    s = _bf16_scale(scale).to(torch.float64)
    out = torch.empty(*packed.shape[:-1], in_features, dtype=torch.float64)
    for j in range(in_features):
        q = ((p[..., j // 8] >> (4 * (j % 8))) & 0xF) - 8
        out[..., j] = q.to(torch.float64) * s[..., j // GROUP]
    return out.to(dtype)


def encode_int4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` float -> (packed int32 ``[..., out, ceil(in/8)]``, scale bf16 ``[..., out, ceil(in/32)]``):
    per group the scale ``stored_scales`` picks (``bf16(amax / 7)``), codes ``grid_codes`` (``q + 8``)."""
    in_features = w.shape[-1]
    x = groups(w.float())
    scale = stored_scales("int4", x.abs().amax(-1))
    q = grid_codes("int4", x, scale_values("int4", scale)).flatten(-2)[..., :in_features]
    words = -(-in_features // 8)
    q = torch.nn.functional.pad(q, (0, words * 8 - in_features), value=8).view(*w.shape[:-1], words, 8)
    packed = (q << (4 * torch.arange(8))).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, scale


def decode(
    fmt: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    dtype: torch.dtype = torch.float32,
    reference: bool = False,
) -> torch.Tensor:
    """Decode a ``fmt`` weight (see the module docstring) to ``[..., out, in]`` of ``dtype``."""
    packed_spec(fmt, in_features)
    if fmt == "mxfp4":
        return (decode_mxfp4_reference if reference else decode_mxfp4)(packed, scale, in_features, dtype)
    return (decode_int4_reference if reference else decode_int4)(packed, scale, in_features, dtype)


def encode(fmt: str, w: torch.Tensor, scale_bits: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., out, in]`` to ``fmt``; ``scale_bits``: the int4 scale as its uint8 bytes
    (a layer's storage)."""
    packed_spec(fmt, w.shape[-1], "w")
    if fmt == "mxfp4":
        return encode_mxfp4(w)
    packed, scale = encode_int4(w)
    return packed, (scale.view(torch.uint8) if scale_bits else scale)


def nbytes(fmt: str, out: int, in_features: int, experts: Optional[int] = 1) -> int:
    """Bytes of ``experts`` packed ``[out, in]`` weights with their scales."""
    return (experts or 1) * packed_spec(fmt, in_features).nbytes(out)


# The encoders' rules, one definition each: the grouping, the scale picked for a group, the code a value
# rounds to under a scale. The encoders above are built from them and the requantised export's self-check
# (export/requantised.py) brackets written codes with them, so the two cannot drift apart.


def groups(x: torch.Tensor) -> torch.Tensor:
    """``[..., in]`` -> ``[..., ceil(in/32), 32]``, zero padded: the groups sharing one scale."""
    n = -(-x.shape[-1] // GROUP)
    return torch.nn.functional.pad(x, (0, n * GROUP - x.shape[-1])).view(*x.shape[:-1], n, GROUP)


def stored_scales(fmt: str, amax: torch.Tensor) -> torch.Tensor:
    """The scale the encoder picks for groups whose largest magnitude is ``amax`` (fp32 ``[...]``), as stored:
    MXFP4 the uint8 E8M0 exponent of ``2 ** (floor(log2 amax) - 2)`` (E2M1's largest exponent is 2; a zero group
    gets the smallest, 2**-127; clamped to [-127, 127], 0xFF never), INT4 ``bf16(amax / 7)``."""
    if fmt == "mxfp4":
        exp = torch.where(
            amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-127))) - 2, torch.full_like(amax, -127.0)
        ).clamp(-127, 127)
        return (exp + 127).to(torch.uint8)
    if fmt == "int4":
        return (amax / 7).to(torch.bfloat16)
    raise ValueError(f"format: unknown packed format {fmt!r}; expected one of {FORMATS}")


def scale_values(fmt: str, scales: torch.Tensor) -> torch.Tensor:
    """Stored scales as fp32 values: MXFP4 uint8 E8M0 ``2 ** (s - 127)``; INT4 bf16, or its uint8 bytes as a layer
    keeps them (``[..., 2 * groups]`` -> ``[..., groups]``)."""
    if fmt == "mxfp4":
        return _pow2(scales)
    if fmt == "int4":
        return _bf16_scale(scales).float()
    raise ValueError(f"format: unknown packed format {fmt!r}; expected one of {FORMATS}")


def group_scales(fmt: str, amax: torch.Tensor) -> torch.Tensor:
    """``scale_values`` of ``stored_scales``: the encoder's scale for ``amax`` as fp32; monotone in ``amax``."""
    return scale_values(fmt, stored_scales(fmt, amax))


def grid_codes(fmt: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Grouped ``x [..., groups, 32]`` under fp32 ``scale [..., groups]`` -> int64 codes ``[..., groups, 32]``: MXFP4
    the E2M1 code nearest ``x / scale``, saturating at 6, the sign bit x's; on a tie the smaller magnitude (so
    0.75, 1.75, 3.5 go down, where the OCP MX round-half-to-even would take 1, 2, 4). INT4
    ``clamp(round(x / scale), -8, 7) + 8`` (halves to even). A zero scale divides by 1 (its values are 0)."""
    s = scale.unsqueeze(-1)
    y = x / torch.where(s > 0, s, torch.ones((), device=s.device))
    if fmt == "mxfp4":
        magnitudes = torch.tensor(E2M1[:8], device=x.device)
        # nearest magnitude; argmin takes the first (the smaller) on a tie
        idx = (y.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
        return idx | (torch.signbit(y).to(torch.int64) << 3)
    if fmt == "int4":
        return torch.clamp(torch.round(y), -8, 7).to(torch.int64) + 8
    raise ValueError(f"format: unknown packed format {fmt!r}; expected one of {FORMATS}")


def round_to_grid(fmt: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` quantised with the per-group fp32 ``scale [..., ceil(in/32)]`` and decoded, fp32 ``[..., in]``:
    what the encoder's codes decode to when it picks ``scale``. Monotone in ``x`` for a fixed scale (what the
    requantised check relies on)."""
    values = torch.tensor(_CODE_VALUES[fmt], device=x.device)
    s = scale.float()
    q = values[grid_codes(fmt, groups(x.float()), s)] * s.unsqueeze(-1)
    return q.flatten(-2)[..., : x.shape[-1]]


def round_to_grid_reference(fmt: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round_to_grid`` value by value (the plain reference): the grid value nearest ``x / scale`` (MXFP4 the
    E2M1 magnitudes with x's sign, the smaller on a tie; INT4 the integers -8..7, halves to even), times the
    scale, in float64 then fp32."""
    grid = sorted(set(abs(v) for v in E2M1))
    flat_x = x.reshape(-1, x.shape[-1]).double()
    out = torch.empty(flat_x.shape, dtype=torch.float64)
    flat_s = scale.reshape(-1, scale.shape[-1]).double()
    for i in range(flat_x.shape[0]):
        for j in range(flat_x.shape[1]):
            s = float(flat_s[i, j // GROUP])
            v = float(flat_x[i, j]) / s if s > 0 else 0.0
            if fmt == "mxfp4":
                best = min(grid, key=lambda m: (abs(abs(v) - m), m))
                best = -best if v < 0 else best
            else:
                best = max(-8, min(7, round(v)))  # Python rounds halves to even, as torch.round does
            out[i, j] = best * s
    return out.view(x.shape).float()
