"""Activation checkpointing (moe_plugin/layers/recompute.py) on the Hugging Face model, one process: "selective"
and "full" give "off"'s loss and every gradient bitwise (non-reentrant checkpointing keeps the forward's graph and
the CPU recompute is deterministic), the router runs once per MoE layer per forward and the expert loads are
"off"'s, each mode recomputes the regions its table names and keeps fewer bytes than the one before; and
transformers' switch (``gradient_checkpointing_enable``) is the same mechanism."""

from __future__ import annotations

import pytest
import torch

from moe_plugin.layers.recompute import MODES, RECOMPUTED, check_mode, set_recompute
from moe_plugin.lora import add_lora, lora_config
from moe_plugin.models import MoEPluginForCausalLM, preset_config

TARGETS = dict(
    target_modules=["q_proj", "k_proj", "gate", "wq_b"], target_parameters=["experts.w1", "experts.w2", "experts.w3"]
)


def _model(attn_res: bool, expert_format: str = "dense", lora: bool = True):
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny", attn_res=attn_res, expert_format=expert_format)).train()
    if lora:
        model = add_lora(model, lora_config(4, 8, **TARGETS), wrap=True)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # away from zero, so that every adapter factor gets a gradient
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _layers(model):
    return [m for m in model.modules() if type(m).__name__ == "DecoderLayer"]


def _count_calls(model):
    """Forward (pre-hook) calls per kind of module: a region recomputed in the backward runs its modules again."""
    counts = {}

    def hook(kind):
        return lambda *_: counts.__setitem__(kind, counts.get(kind, 0) + 1)

    for layer in _layers(model):
        layer.input_layernorm.register_forward_pre_hook(hook("input_norm"))
        if layer.attn_res:
            layer.self_attention_res_proj.register_forward_pre_hook(hook("attn_res_mix"))
        if layer.is_moe:
            moe = layer.block_sparse_moe
            moe.router.register_forward_pre_hook(hook("router"))
            moe.experts.register_forward_pre_hook(hook("experts"))
            moe.routed_expert_up_proj.register_forward_pre_hook(hook("latent_up"))
    return counts


def _step(model, mode: str, ids, cu):
    set_recompute(model, mode)
    model.zero_grad(set_to_none=True)
    saved = [0]

    def pack(t):
        saved[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, cu_seqlens=cu)
    loads = [layer.block_sparse_moe.pop_load() for layer in _layers(model) if layer.is_moe]
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, loads, out.expert_load, saved[0]


@pytest.mark.parametrize("attn_res,expert_format", [(True, "dense"), (False, "dense"), (True, "mxfp4")])
def test_modes_give_off_bitwise_with_the_router_run_once(attn_res, expert_format):
    model = _model(attn_res, expert_format)
    counts = _count_calls(model)
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 40, 96])
    moe_layers = sum(layer.is_moe for layer in _layers(model))
    runs, calls = {}, {}
    for mode in MODES:
        counts.clear()
        runs[mode] = _step(model, mode, ids, cu)
        calls[mode] = dict(counts)
    loss, grads, loads, expert_load, saved = runs["off"]
    assert any("experts" in n for n in grads) and any("gate" in n for n in grads)
    for mode in ("selective", "full", "full_routing"):
        got = runs[mode]
        assert torch.equal(got[0], loss), mode
        assert sorted(got[1]) == sorted(grads), mode
        for name, g in grads.items():
            assert torch.equal(got[1][name], g), (mode, name)
        assert all(torch.equal(a, b) for a, b in zip(got[2], loads)) and torch.equal(got[3], expert_load), mode
        # the router never reruns; the experts and the latent up-projection are recomputed in both modes
        assert calls[mode]["router"] == moe_layers, (mode, calls[mode])
        assert calls[mode]["experts"] == calls[mode]["latent_up"] == 2 * moe_layers, (mode, calls[mode])
        assert calls[mode]["input_norm"] == 2 * len(_layers(model)), (mode, calls[mode])
    assert calls["off"]["router"] == calls["off"]["experts"] == moe_layers
    if attn_res:  # both recompute the AttnRes mixes (their norms), from the candidates the forward mixed; but
        # "selective"'s own region for layer 0's attention mix (the frozen embedding alone, frozen weights) saved
        # nothing to redo, where "full" redoes layer 0 up to its MLP as one region
        assert calls["off"]["attn_res_mix"] == len(_layers(model))
        assert calls["selective"]["attn_res_mix"] == 2 * len(_layers(model)) - 1
        assert calls["full"]["attn_res_mix"] == 2 * len(_layers(model))
    assert runs["full"][4] < runs["selective"][4] < saved, [runs[m][4] for m in MODES]
    # "full_routing" keeps the MoE's routing only: the sorted copies it sent are recomputed too
    assert runs["full_routing"][4] < runs["full"][4], [runs[m][4] for m in MODES]


def test_the_table_names_the_regions_every_mode_recomputes():
    assert RECOMPUTED["off"] == frozenset()
    # routing is no region of any mode: it is computed once and kept; only "full_routing" reruns the dispatch
    assert all("route" not in regions for regions in RECOMPUTED.values())
    assert [mode for mode, regions in RECOMPUTED.items() if "dispatch" in regions] == ["full_routing"]
    assert "layer" in RECOMPUTED["full"] and "attention" in RECOMPUTED["selective"]
    assert check_mode("full") == "full"
    with pytest.raises(ValueError, match=r"^schedule.activation_checkpointing: expected one of"):
        check_mode("on")


def test_a_cache_is_never_recomputed_into():
    model = _model(True, lora=False)
    set_recompute(model, "full")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        set_recompute(model, "off")
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        set_recompute(model, "full")
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_transformers_switch_is_the_same_mechanism():
    model = _model(True, lora=False)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    loss, grads, *_ = _step(model, "off", ids, None)
    assert model.supports_gradient_checkpointing and not model.is_activation_checkpointing
    for kwargs, mode in ((None, "full"), ({"mode": "selective"}, "selective"), ({"use_reentrant": False}, "full")):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert model.is_activation_checkpointing
        assert {layer.recompute_mode for layer in _layers(model)} == {mode}
        assert {m.recompute_mode for m in model.modules() if hasattr(m, "moe_config")} == {mode}
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert torch.equal(out.loss.detach(), loss)
        assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters()), kwargs
    model.activation_checkpointing_disable()
    assert {layer.recompute_mode for layer in _layers(model)} == {"off"} and not model.is_activation_checkpointing
    with pytest.warns(FutureWarning):  # the deprecated name (peft, older callers) reaches the same switch
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"mode": "selective"})
    assert {layer.recompute_mode for layer in _layers(model)} == {"selective"}
    with pytest.raises(ValueError, match=r"^activation_checkpointing_kwargs.use_reentrant: must be False"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=r"^activation_checkpointing_kwargs.mode: expected one of"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"mode": "everything"})


def test_the_recipe_key_names_the_same_modes():
    from typing import get_args

    from moe_plugin.recipe.schema import ScheduleSection, recipe_from_dict

    assert get_args(ScheduleSection.model_fields["activation_checkpointing"].annotation) == MODES
    assert ScheduleSection().activation_checkpointing == "off"
    with pytest.raises(
        ValueError,
        match=r'schedule.activation_checkpointing: must be one of "off", "selective", '
        r'"full", "full_routing", got \'on\'',
    ):
        recipe_from_dict(
            {"output_dir": "out", "model": {"preset": "tiny"}, "schedule": {"activation_checkpointing": "on"}}
        )
