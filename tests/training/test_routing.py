"""Balancing the selection bias in full training (the loop's update on every layer moe_layers finds), and the
per-layer load it reads."""

import torch

import moe_plugin
from moe_plugin import MoEPluginForCausalLM
from moe_plugin.training.metrics.routing import moe_layers


def _model():
    torch.manual_seed(0)
    return MoEPluginForCausalLM(moe_plugin.preset_config("tiny", vision_config=None, image_token_id=None))


def test_balance_moves_bias_against_the_load():
    """What training.step_math.balance_loads does with the summed load: each layer's sign update."""
    model = _model()
    layers = moe_layers(model)
    load = torch.zeros(len(layers), 8)
    load[:, 0] = 100.0  # expert 0 overloaded, the rest idle
    for layer, row in zip(layers, load):
        layer.update_routing_bias(row)
    for layer in layers:
        bias = layer.router.e_score_correction_bias
        assert bias[0] < 0 and bool((bias[1:] > 0).all())


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
