"""Balancing the selection bias in full training, and measuring routing drift under a LoRA'd router."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import moe_plugin
from moe_plugin import MoEPluginForCausalLM
from moe_plugin.training.routing import RoutingDriftMonitor, balance_experts, moe_layers


def _model():
    torch.manual_seed(0)
    return MoEPluginForCausalLM(moe_plugin.preset_config("tiny", vision_config=None, image_token_id=None))


def test_balance_moves_bias_against_the_load():
    model = _model()
    layers = moe_layers(model)
    load = torch.zeros(len(layers), 8)
    load[:, 0] = 100.0  # expert 0 overloaded, the rest idle
    ratio = balance_experts(model, load)
    assert ratio == pytest.approx(8.0)
    for layer in layers:
        bias = layer.router.e_score_correction_bias
        assert bias[0] < 0 and bool((bias[1:] > 0).all())


def test_balance_checks_the_layer_count():
    with pytest.raises(ValueError, match="expert_load"):
        balance_experts(_model(), torch.ones(1, 8))


def test_drift_is_zero_for_a_fresh_adapter_and_grows_when_it_moves():
    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["gate"]))
    monitor = RoutingDriftMonitor(model)
    assert monitor.active
    ids = torch.randint(0, 272, (1, 64))
    model(input_ids=ids)
    assert monitor.pop() == 0.0  # lora_B starts at zero: same choices as the base
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 5.0)
    model(input_ids=ids)
    assert monitor.pop() > 0.1
    assert monitor.pop() is None
    monitor.close()
    model(input_ids=ids)
    assert monitor.pop() is None


def test_no_monitor_without_a_router_adapter():
    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert not RoutingDriftMonitor(model).active


def test_last_load_accumulates_over_micro_batches_until_popped():
    model = _model()
    layers = moe_layers(model)
    ids = [torch.randint(0, 272, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    per_call = [model(input_ids=x).expert_load for x in ids]
    with torch.no_grad():
        model(input_ids=ids[0])  # evaluation is not counted
    for row, layer in enumerate(layers):
        want = per_call[0][row] + per_call[1][row]
        assert torch.equal(layer.last_load, want), f"layer {row}: {layer.last_load} vs {want}"
        assert torch.equal(layer.pop_load(), want) and layer.last_load is None
        assert layer.pop_load() is None
