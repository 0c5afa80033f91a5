"""Packed experts on one device: the Hugging Face model loaded from a K3-format MXFP4/INT4 checkpoint gives the
logits and LoRA gradients of its dequantised fp32 twin (peft target_parameters, peft's adapter layout), keeps
its bytes through model.to(bf16) / .half(), holds exactly the packed size, dequantises at most one group at a
time, and names the tensor on bad input. Also the merged exports."""

from __future__ import annotations

import weakref

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

import moe_plugin.ops.quant.experts as quant_experts
from moe_plugin.layers.packed_experts import PackedStackedExperts
from moe_plugin.lora import add_lora, lora_config
from moe_plugin.models.k3_format import load_k3_checkpoint
from moe_plugin.ops.quant import decode, encode
from moe_plugin.testing.packed_checkpoints import write_tiny_packed_checkpoint
from moe_plugin.weights.quantize import merge_expert_adapter

TARGETS = dict(
    target_modules=["q_proj", "k_proj", "gate"], target_parameters=["experts.w1", "experts.w2", "experts.w3"]
)


@pytest.fixture(scope="module", params=["mxfp4", "int4"])
def bases(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    write_tiny_packed_checkpoint(tmp / "packed", request.param, seed=2, dequantized_path=tmp / "fp32", attn_res=False)
    return request.param, tmp / "packed", tmp / "fp32"


def _adapted(path):
    torch.manual_seed(0)
    model = add_lora(load_k3_checkpoint(path).train(), lora_config(4, 8, **TARGETS), wrap=True)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that every adapter factor gets a gradient
            with torch.no_grad():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _experts(model):
    return [m for m in model.modules() if getattr(m, "is_packed", False)]


def test_logits_and_lora_gradients_equal_the_dequantized_model(bases):
    fmt, packed_path, dense_path = bases
    packed, dense = _adapted(packed_path), _adapted(dense_path)
    assert _experts(packed) and not _experts(dense)
    ids = torch.tensor([[(5 * i + 1) % 384 for i in range(40)]])
    out_p, out_d = packed(input_ids=ids, labels=ids), dense(input_ids=ids, labels=ids)
    scale = float(out_d.logits.abs().max())
    assert float((out_p.logits - out_d.logits).abs().max()) <= 1e-5 * scale
    out_p.loss.backward()
    out_d.loss.backward()
    grads_d = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
    grads_p = {n: p.grad for n, p in packed.named_parameters() if p.requires_grad}
    assert sorted(grads_p) == sorted(grads_d) and any("experts" in n for n in grads_d)
    for name, g in grads_d.items():
        assert float(g.abs().max()) > 0, name
        assert float((grads_p[name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name
    # the adapter file is peft's own layout: the same keys and shapes as over the dense experts
    saved_p, saved_d = get_peft_model_state_dict(packed), get_peft_model_state_dict(dense)
    assert {k: v.shape for k, v in saved_p.items()} == {k: v.shape for k, v in saved_d.items()}


def test_precision_changes_leave_the_packed_bytes_as_stored(bases):
    fmt, packed_path, _ = bases
    model = load_k3_checkpoint(packed_path)
    before = {n: p.detach().clone() for e in _experts(model) for n, p in e.named_parameters()}
    for change in (
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.to(dtype=torch.float64),
    ):
        change(model)
        after = {n: p for e in _experts(model) for n, p in e.named_parameters()}
        for name, value in before.items():
            assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    assert model.model.embed_tokens.weight.dtype == torch.float64  # the dense part did change


def test_resident_bytes_are_the_packed_size(bases):
    fmt, packed_path, _ = bases
    model = load_k3_checkpoint(packed_path)
    experts = _experts(model)
    weights = sum(3 * 8 * 32 * 32 for _ in experts)
    bits = 4.25 if fmt == "mxfp4" else 4.5  # INT4's scales are bf16 (16 bits per 32 weights)
    resident = sum(p.numel() * p.element_size() for e in experts for p in e.parameters())
    assert resident * 8 == weights * bits == sum(e.packed_nbytes() for e in experts) * 8


def test_at_most_one_group_is_dequantized_at_a_time(monkeypatch):
    fmt, e, out, inp = "mxfp4", 8, 32, 64
    packed, scale = encode(fmt, torch.randn(e, out, inp), scale_bits=True)
    live, peak = [0], [0]
    real = quant_experts.dequantize_experts

    def tracked(*args, **kwargs):
        w = real(*args, **kwargs)
        size = w.numel() * w.element_size()
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(w, lambda n=size: live.__setitem__(0, live[0] - n))  # the callback must not hold w
        return w

    monkeypatch.setattr(quant_experts, "dequantize_experts", tracked)
    x = torch.randn(40, inp, requires_grad=True)
    counts = torch.full((e,), 5)
    quant_experts.packed_grouped_linear(x, counts, packed, scale, fmt, inp, group_size=2).sum().backward()
    assert peak[0] == 2 * out * inp * 4  # one group of 2 experts in fp32, forward and backward alike
    assert live[0] == 0


def test_bad_checkpoint_tensors_are_named(bases, tmp_path):
    fmt, packed_path, _ = bases
    stored = load_file(str(packed_path / "model.safetensors"))
    key = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    cases = {
        "shape": {f"{key}.weight_packed": stored[f"{key}.weight_packed"][:, :2]},
        "missing": {f"{key}.weight_scale": None},
    }
    if fmt == "mxfp4":
        bad = stored[f"{key}.weight_scale"].clone()
        bad[0, 0] = 0xFF
        cases["nan"] = {f"{key}.weight_scale": bad}
    for case, change in cases.items():
        tensors = dict(stored)
        for k, v in change.items():
            if v is None:
                del tensors[k]
            else:
                tensors[k] = v.contiguous()
        path = tmp_path / case
        path.mkdir()
        (path / "config.json").write_text((packed_path / "config.json").read_text())
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + r"\.weight_(packed|scale)"):
            load_k3_checkpoint(path)
    config = (packed_path / "config.json").read_text().replace('"format": "', '"format": "nv', 1)
    (tmp_path / "fmt").mkdir()
    (tmp_path / "fmt" / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"text_config\.quantization_config(\.config_groups\.group_0)?\.format"):
        load_k3_checkpoint(tmp_path / "fmt")


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_merged_exports(fmt):
    g = torch.Generator().manual_seed(4)
    e, out, inp, r = 3, 16, 64, 2
    packed, scale = encode(fmt, torch.randn(e, out, inp, generator=g), scale_bits=True)
    a, b = torch.randn(r * e, inp, generator=g), torch.randn(out, r * e, generator=g)
    merged = merge_expert_adapter(fmt, packed, scale, inp, a, b, 0.5, dtype=torch.float32)
    base = decode(fmt, packed, scale, inp)
    for j in range(e):  # expert j's delta: its rows of A, its (expert-minor) columns of B
        assert torch.allclose(merged.weight[j], base[j] + 0.5 * b[:, j::e] @ a[j * r : (j + 1) * r], atol=1e-5)
    zero = merge_expert_adapter(fmt, packed, scale, inp, a, torch.zeros_like(b), 0.5, requantize=True)
    assert zero.changed == 0  # nothing to merge: no value changes (a -0 code may come back as +0)
    assert torch.equal(decode(fmt, zero.packed, zero.scale, inp), base)
    moved = merge_expert_adapter(fmt, packed, scale, inp, a, b, 0.5, requantize=True)
    after = decode(fmt, moved.packed, moved.scale, inp)
    assert moved.changed == int((after != base).sum()) > 0


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_packed_experts_compile_in_one_graph(fmt):
    """The packed experts' three projections with an adapter (``grouped_lora``) trace with ``fullgraph=True``: the
    product is the custom op ``moe_plugin::packed_grouped_linear``, whose group bounds are read inside its eager
    kernel. Compiled equals eager, forward and backward."""
    from moe_plugin.ops.quant import grouped_lora

    torch.manual_seed(0)
    e, dim, inter = 4, 32, 64
    experts = PackedStackedExperts(e, dim, inter, expert_format=fmt, group_size=2)
    a, b = torch.randn(e, 4, dim) * 0.1, torch.randn(e, inter, 4) * 0.1

    def layer(x, counts):
        gate = experts._project("w1", x, counts) + grouped_lora(x, counts, a, b, 2.0)
        up = experts._project("w3", x, counts)
        return experts._project("w2", torch.nn.functional.silu(gate) * up, counts)

    x = torch.randn(12, dim, requires_grad=True)
    counts, probe = torch.tensor([3, 0, 7, 2]), torch.randn(12, dim)
    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, counts)
    (grad,) = torch.autograd.grad((out * probe).sum(), x)
    torch._dynamo.reset()
    ref = layer(x, counts)
    (grad_ref,) = torch.autograd.grad((ref * probe).sum(), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, grad_ref)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        layer(x, torch.tensor([3, 0, 7, 1]))  # 11 rows counted for 12
