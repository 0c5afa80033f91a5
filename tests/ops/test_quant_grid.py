"""The encoders' rules (ops/quant/formats.py): the scale an encoder stores is ``group_scales`` of its group's
largest magnitude and its codes decode to ``round_to_grid`` at that scale, over random weights with planted
rounding ties, zeros (values, -0.0, whole groups) and values past the grid's end; ``round_to_grid`` equals its
plain reference; and the tie and saturation rules are the documented ones."""

from __future__ import annotations

import pytest
import torch

from moe_plugin.ops.quant import (
    E2M1,
    decode,
    encode,
    grid_codes,
    group_scales,
    groups,
    round_to_grid,
    round_to_grid_reference,
    scale_values,
    stored_scales,
)

FORMATS = ("mxfp4", "int4")
TOP = {"mxfp4": 6.0, "int4": 7.0}  # the largest magnitude the encoder's scale maps a group's maximum near
HALVES = {"mxfp4": (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), "int4": (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5)}


def _weights(fmt: str, seed: int, shape=(2, 3, 70)) -> torch.Tensor:
    """Random weights of mixed magnitudes with planted ties, zeros and -0.0; widths not a multiple of 32 too."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 4, shape[:-1] + (1,), generator=g)
    w[0, 0, :32] = 0  # a whole zero group
    w[0, 1, 3:9] = 0
    w[0, 1, 9] = -0.0
    # a group whose maximum makes the scale exactly 2 ** k, every other value half way between two grid values
    k = int(torch.randint(-4, 4, (), generator=g))
    halves = torch.tensor(HALVES[fmt])
    row = halves[torch.randint(0, len(halves), (32,), generator=g)] * torch.sign(torch.randn(32, generator=g))
    row[0] = TOP[fmt]
    w[1, 2, :32] = row * 2.0**k
    return w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_the_encoders_scale_is_group_scales_and_its_values_round_to_grid(fmt, seed):
    w = _weights(fmt, seed, (2, 3, 70) if fmt == "int4" else (2, 3, 66))
    codes, scales = encode(fmt, w, scale_bits=True)
    amax = groups(w).abs().amax(-1)  # [2, 3, 3]
    scale = scale_values(fmt, scales)
    assert torch.equal(scale, group_scales(fmt, amax))
    assert torch.equal(
        scales.view(torch.uint8) if fmt == "int4" else scales, stored_scales(fmt, amax).view(torch.uint8)
    )
    got = decode(fmt, codes, scales, w.shape[-1], torch.float32)
    grid = round_to_grid(fmt, w, scale)
    assert torch.equal(got, grid)
    assert torch.equal(grid, round_to_grid_reference(fmt, w, scale))
    if fmt == "mxfp4":  # the sign bit of -0.0 is kept (code 8): decoded -0.0, equal to 0 either way
        assert bool(torch.signbit(got[0, 1, 9])) and not bool(got[0, 0, :32].any())


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_and_saturation_follow_the_documented_rules(fmt):
    ties = torch.tensor(HALVES[fmt])
    x = torch.cat([ties, -ties, torch.tensor([100.0, -100.0, 0.0, -0.0])]).view(1, -1)  # [1, 18]
    scale = torch.ones(1, 1)
    got = round_to_grid(fmt, x, scale)
    if fmt == "mxfp4":  # the smaller magnitude on a tie; saturating at 6
        down = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    else:  # halves to even; the codes stop at -8 and 7
        down = [0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    assert got[0, :7].tolist() == down and got[0, 7:14].tolist() == [-v for v in down]
    top, bottom = (6.0, -6.0) if fmt == "mxfp4" else (7.0, -8.0)
    assert got[0, 14:].tolist() == [top, bottom, 0.0, 0.0]
    assert torch.equal(got, round_to_grid_reference(fmt, x, scale))
    # 8 x the encoder's own scale is past the grid for every group that is not all zero
    w = _weights(fmt, 9, (2, 3, 64))
    _, scales = encode(fmt, w)
    s = scale_values(fmt, scales)
    big = round_to_grid(fmt, w * 8, s)
    per_value = s.repeat_interleave(32, -1)
    units = big.abs() / torch.where(per_value > 0, per_value, torch.ones(()))
    assert float(units.max()) == (6.0 if fmt == "mxfp4" else 8.0) and not bool(big[per_value == 0].any())


def test_the_mxfp4_scale_is_the_power_of_two_below_amax_over_4_and_never_0xff():
    amax = torch.tensor([0.0, 1e-45, 2.0**-130, 1.0, 4.0, 6.0, 7.99, 8.0, 3e38, float("inf")])
    stored = stored_scales("mxfp4", amax)
    assert stored.tolist() == [0, 0, 0, 125, 127, 127, 127, 128, 252, 254]
    assert torch.equal(scale_values("mxfp4", stored), torch.ldexp(torch.ones(10), stored.int() - 127))
    assert torch.equal(group_scales("mxfp4", amax), scale_values("mxfp4", stored))
    assert torch.equal(group_scales("int4", amax), (amax / 7).to(torch.bfloat16).float())


def test_grid_codes_are_the_e2m1_codes_with_the_sign_bit():
    values = torch.tensor(E2M1).view(1, 16)
    x = torch.nn.functional.pad(values, (0, 16)).view(1, 1, 32)
    codes = grid_codes("mxfp4", x, torch.ones(1, 1))
    assert codes[0, 0, :16].tolist() == list(range(16))  # every E2M1 value is its own code, -0.0 included


def test_an_unknown_format_is_named():
    for rule in (
        lambda: stored_scales("nvfp4", torch.ones(1)),
        lambda: scale_values("nvfp4", torch.ones(1)),
        lambda: grid_codes("nvfp4", torch.ones(1, 32), torch.ones(1)),
    ):
        with pytest.raises(ValueError, match=r"^format: unknown packed format 'nvfp4'"):
            rule()
