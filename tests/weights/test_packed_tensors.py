"""The one per-expert packed writer (weights/packed_tensors.py) round-trips: a packed model's published tensors,
written by ``testing.packed_checkpoints`` and, for the experts, by the requantised export's
``packed_output_tensors``, load through the packed loader into the same stored bytes and the same decoded
weights (MXFP4 and INT4, an INT4 scale holding a 0xFF byte, K2 names); both callers write the same tensors;
bad stacks are named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_plugin.export.packed import PackedStack, packed_output_tensors
from moe_plugin.models import MoEPluginForCausalLM, preset_config
from moe_plugin.models.k3_format import CONFIG_NAME, load_k3_checkpoint
from moe_plugin.ops.quant import encode
from moe_plugin.testing.packed_checkpoints import dequantized_state_dict, save_packed_k3_checkpoint
from moe_plugin.weights.packed_tensors import per_expert_tensors

PREFIX = "language_model."


def _model(fmt: str) -> MoEPluginForCausalLM:
    torch.manual_seed(7)
    model = MoEPluginForCausalLM(
        preset_config("tiny", expert_format=fmt, attn_res=False, vision_config=None, image_token_id=None)
    )
    if fmt == "int4":  # bf16 0x3CFF (about 0.031) is a finite scale whose low byte is 0xFF
        scale = dict(model.named_buffers(), **dict(model.named_parameters()))[
            "model.layers.1.block_sparse_moe.experts.w2_scale"
        ]
        with torch.no_grad():
            scale[3, 0, :2] = torch.tensor([0xFF, 0x3C], dtype=torch.uint8)
    return model


def _stacks(model):
    """``{...experts.w1: (PackedStack, codes, scales)}`` of ``model``'s packed stacks, as a layer keeps them."""
    state = model.state_dict()
    return {
        f"{p}.{k}": (PackedStack(f"{p}.{k}", m.expert_format, tuple(shape)), state[f"{p}.{k}"], state[f"{p}.{k}_scale"])
        for p, m in model.named_modules()
        if getattr(m, "is_packed", False)
        for k, shape in m.logical_shapes.items()
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _assert_loads_back(model, path):
    loaded = load_k3_checkpoint(path)
    want, got = model.state_dict(), loaded.state_dict()
    stacks = _stacks(model)
    for name in stacks:  # the stored bytes themselves
        assert _same_bytes(got[name], want[name]) and _same_bytes(got[name + "_scale"], want[name + "_scale"]), name
    decoded, again = dequantized_state_dict(model), dequantized_state_dict(loaded)
    assert sorted(decoded) == sorted(again)
    for name in stacks:
        assert torch.equal(again[name], decoded[name]) and bool(torch.isfinite(again[name]).all()), name


@pytest.mark.parametrize("fmt,naming", [("mxfp4", "k3"), ("int4", "k3"), ("int4", "k2")])
def test_a_packed_models_checkpoint_loads_back_to_the_same_bytes_and_weights(fmt, naming, tmp_path):
    model = _model(fmt)
    save_packed_k3_checkpoint(model, tmp_path / "ckpt", naming=naming)
    if fmt == "int4":
        stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
        expert = "mlp.experts.3.down_proj" if naming == "k2" else "block_sparse_moe.experts.3.w2"
        scale = stored[f"{PREFIX}model.layers.1.{expert}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and scale[0, 0].view(torch.int16).item() == 0x3CFF
    _assert_loads_back(model, tmp_path / "ckpt")


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_the_exports_expert_tensors_are_the_models_and_load_back(fmt, tmp_path):
    """The requantised export's "k3" tensors of each stack, in place of the model writer's, load back as well."""
    model = _model(fmt)
    save_packed_k3_checkpoint(model, tmp_path / "model")
    published = load_file(str(tmp_path / "model" / "model.safetensors"))
    exported = {}
    for stack, codes, scales in _stacks(model).values():
        exported.update((PREFIX + n, t) for n, t in packed_output_tensors(stack, codes, scales, "k3"))
    assert exported and set(exported) <= set(published)
    for name, tensor in exported.items():
        assert _same_bytes(tensor, published[name]), name
    rest = {n: t for n, t in published.items() if n not in exported}
    assert not any(".weight_packed" in n or ".weight_scale" in n or ".weight_shape" in n for n in rest)
    out = tmp_path / "export"
    out.mkdir()
    (out / CONFIG_NAME).write_text(json.dumps(json.loads((tmp_path / "model" / CONFIG_NAME).read_text())))
    save_file({**rest, **exported}, str(out / "model.safetensors"), metadata={"format": "pt"})
    _assert_loads_back(model, out)


def test_the_writers_names_order_and_copies():
    w = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0))
    codes, scales = encode("int4", w, scale_bits=True)
    got = per_expert_tensors("model.layers.1.block_sparse_moe.experts.w2", "int4", codes, scales, (2, 4, 64))
    head = "model.layers.1.block_sparse_moe.experts"
    assert [n for n, _ in got] == [f"{head}.{e}.w2.weight_{k}" for e in range(2) for k in ("packed", "scale", "shape")]
    assert got[5][1].tolist() == [4, 64] and got[5][1].dtype == torch.int32
    assert _same_bytes(got[4][1], scales[1].view(torch.bfloat16)) and got[3][1].data_ptr() != codes[1].data_ptr()
    bf16 = per_expert_tensors(f"{head}.w2", "int4", codes, scales.view(torch.bfloat16), (2, 4, 64))
    assert all(_same_bytes(a, b) for (_, a), (_, b) in zip(bf16, got))  # bf16 scales as they are
    k2 = per_expert_tensors(f"{head}.w1", "int4", codes, scales, (2, 4, 64), naming="k2")
    assert [n for n, _ in k2][:3] == [
        f"model.layers.1.mlp.experts.0.gate_proj.weight_{k}" for k in ("packed", "scale", "shape")
    ]
    mx_codes, mx_scales = encode("mxfp4", w)
    mx = per_expert_tensors(f"{head}.w1", "mxfp4", mx_codes, mx_scales, (2, 4, 64))
    assert [n for n, _ in mx] == [f"{head}.{e}.w1.weight_{k}" for e in range(2) for k in ("packed", "scale")]


def test_a_stack_the_loader_would_refuse_is_named():
    w = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = encode("mxfp4", w)
    name = "model.layers.1.block_sparse_moe.experts.w1"
    bad = scales.clone()
    bad[1, 2, 0] = 0xFF
    with pytest.raises(
        ValueError,
        match=rf"^{name}: scale byte 0xFF \(NaN in the MX specification\) at index "
        r"\[1, 2, 0\]",
    ):
        per_expert_tensors(name, "mxfp4", codes, bad, (2, 4, 64))
    with pytest.raises(ValueError, match=rf"^{name}: packed values of a \[3, 4, 64\] stack must be \[3, 4, \.\.\.\]"):
        per_expert_tensors(name, "mxfp4", codes, scales, (3, 4, 64))
    with pytest.raises(ValueError, match=rf"^{name}: mxfp4 packed values of 48 columns"):
        per_expert_tensors(name, "mxfp4", codes, scales, (2, 4, 48))
    with pytest.raises(ValueError, match=r"^naming: must be one of \('k3', 'k2'\), got 'k4'"):
        per_expert_tensors(name, "mxfp4", codes, scales, (2, 4, 64), naming="k4")
