"""export/packed.py and export/requantised.py as functions: decoding a packed stream, the names a requantised stack
is written under, and the requantised check's bounds (a rounding tie passes, a dropped or wrong expert is
named). The rules the check is built from (``ops.quant.round_to_grid``, ``group_scales``) are tested in
tests/ops/test_quant_grid.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moe_plugin.export.packed import PackedStack, decoded, packed_output_tensors, requantise
from moe_plugin.export.requantised import check_requantised_stack
from moe_plugin.export.targets import Target
from moe_plugin.export.verify import CheckResult
from moe_plugin.ops.quant import decode, encode, scale_values

FORMATS = ("mxfp4", "int4")


def _weights(seed: int, shape=(3, 5, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoded_stream_yields_each_stack_once_decoded(fmt):
    w = _weights(2)
    codes, scales = encode(fmt, w, scale_bits=True)
    stack = PackedStack("m.experts.w1", fmt, tuple(w.shape))
    stream = [("m.norm", torch.ones(2)), ("m.experts.w1_scale", scales), ("m.experts.w1", codes)]
    out = list(decoded(stream, {stack.name: stack}, keep_packed=True))
    assert [n for n, _, _ in out] == ["m.norm", "m.experts.w1"]
    assert torch.equal(out[1][1], decode(fmt, codes, scales, 64, torch.float32)) and out[1][2][0] is codes
    with pytest.raises(ValueError, match=r"base: packed expert stacks without their scales .*m\.experts\.w1"):
        list(decoded(stream[2:], {stack.name: stack}))


def test_k3_names_of_a_requantised_int4_stack():
    w = _weights(3, (2, 4, 32))
    codes, scales = encode("int4", w, scale_bits=True)
    out = dict(
        packed_output_tensors(
            PackedStack("model.layers.1.block_sparse_moe.experts.w2", "int4", (2, 4, 32)), codes, scales, "k3"
        )
    )
    name = "model.layers.1.block_sparse_moe.experts.1.w2"
    assert out[f"{name}.weight_scale"].dtype == torch.bfloat16  # as published
    assert torch.equal(out[f"{name}.weight_shape"], torch.tensor([4, 32], dtype=torch.int32))
    assert torch.equal(out[f"{name}.weight_packed"], codes[1]) and len(out) == 6


def _case(fmt: str):
    base_w = _weights(4)
    codes, scales = encode(fmt, base_w, scale_bits=True)
    base = decode(fmt, codes, scales, 64, torch.float32)
    delta = _weights(5) * 0.3
    target = Target("model.layers.1.block_sparse_moe.experts.w1", "x", 3, 2.0)
    return PackedStack(target.weight, fmt, (3, 5, 64)), target, base, delta


@pytest.mark.parametrize("fmt", FORMATS)
def test_requantised_check_passes_the_requantisation_and_counts_changes(fmt):
    stack, target, base, delta = _case(fmt)
    codes, scales, changed = requantise(stack, base + delta, base)
    got = decode(fmt, codes, scales, 64, torch.float32)
    assert changed == int((got != base).sum()) and 0 < changed < base.numel()
    result = CheckResult()
    # the check's own delta differs in its last bits, as peft's and the export's may
    assert check_requantised_stack(stack, target, base, delta * (1 + 1e-7), codes, scales, result) >= 0
    assert not result.problems and result.deltas_checked == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_value_on_the_other_side_of_a_tie_passes_and_is_counted(fmt):
    stack, target, base, delta = _case(fmt)
    merged = base + delta
    codes, scales = encode(fmt, merged, scale_bits=True)
    scale = scale_values(fmt, scales).repeat_interleave(32, -1)[..., :64]
    # put the check's merged value just past the rounding boundary above one written value (a small one, not its
    # group's largest, so the scale stays): the check's own requantisation rounds it up, the written code is below
    got = decode(fmt, codes, scales, 64, torch.float32)
    units = (got / scale).abs()
    e, o, j = [int(i) for i in ((units > 0) & (units <= 1)).nonzero()[0]]
    half = 0.25 if fmt == "mxfp4" else 0.5  # half the grid spacing at magnitudes up to 1 scale
    sign = float(torch.sign(got[e, o, j]))
    check_delta = delta.clone()
    check_delta[e, o, j] = float(got[e, o, j]) + sign * (half + 1e-6) * float(scale[e, o, j]) - float(base[e, o, j])
    result = CheckResult()
    ties = check_requantised_stack(stack, target, base, check_delta, codes, scales, result)
    assert not result.problems and ties >= 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dropped_or_wrong_expert_is_named(fmt):
    stack, target, base, delta = _case(fmt)
    kept = delta.clone()
    kept[1] = 0  # the export forgot expert 1
    codes, scales, _ = requantise(stack, base + kept, base)
    result = CheckResult()
    check_requantised_stack(stack, target, base, delta, codes, scales, result)
    assert result.problems == [
        f"delta missing for ['{target.weight} expert 1'] (the requantised experts equal the base's)"
    ]
    wrong = delta.clone()
    wrong[2] *= 1.5
    codes, scales, _ = requantise(stack, base + wrong, base)
    result = CheckResult()
    check_requantised_stack(stack, target, base, delta, codes, scales, result)
    assert result.problems == [
        f"delta wrong for ['{target.weight} expert 2'] (not the requantisation of the merged weights)"
    ]


def test_the_bases_floating_dtype_counts_values_and_leaves_packed_scales_out():
    from moe_plugin.export.packed import float_dtype
    from moe_plugin.weights.reads import Stored

    int4_fp32 = {f"m.experts.{e}.w1.weight_scale": Stored("", (32, 1), "bfloat16") for e in range(72)}
    int4_fp32.update({"m.embed.weight": Stored("", (384, 64), "float32"), "m.norm": Stored("", (64,), "float32")})
    assert float_dtype(int4_fp32) == torch.float32
    release = {f"m.{i}.weight": Stored("", (64, 64), "bfloat16") for i in range(3)}
    release.update({f"m.{i}.gate.bias": Stored("", (8,), "float32") for i in range(10)})  # many small fp32
    assert float_dtype(release) == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bf16_packed_base_merges_into_bf16_experts_decoded_exactly(fmt, tmp_path):
    """No adapter: the merged experts are the base's decoded values, in the base's dtype (BF16)."""
    from moe_plugin.export.merge import write_merged
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.testing.packed_checkpoints import save_packed_k3_checkpoint

    torch.manual_seed(3)
    config = preset_config("tiny", expert_format=fmt, attn_res=False)
    model = MoEPluginForCausalLM(config).to(torch.bfloat16)  # the packed bytes stay as they are
    save_packed_k3_checkpoint(model, tmp_path / "base")
    (tmp_path / "out").mkdir()
    written = write_merged(str(tmp_path / "base"), config, {}, {}, str(tmp_path / "out"), "hf", 10**9)
    assert written["expert_format"] == written["float_dtype"] == "bfloat16" and written["merged"] == []
    state = {}
    for f in written["files"]:  # one shard per MoE layer's experts
        if f.endswith(".safetensors"):
            state.update(load_file(str(tmp_path / "out" / f)))
    packed = model.state_dict()
    stacks = [n for n in packed if n.endswith(("experts.w1", "experts.w2", "experts.w3"))]
    assert len(stacks) == 9
    for name in stacks:
        want = decode(fmt, packed[name], packed[name + "_scale"], state[name].shape[-1], torch.float32)
        assert state[name].dtype == torch.bfloat16 and name + "_scale" not in state
        if fmt == "mxfp4":  # E2M1 times a power of two is exact in bf16
            assert torch.equal(state[name].float(), want), name
        else:  # (q - 8) x a bf16 scale needs up to 11 bits: rounded once to bf16
            assert torch.equal(state[name], want.to(torch.bfloat16)), name
    assert all(t.dtype == torch.bfloat16 for n, t in state.items() if "experts" in n)
