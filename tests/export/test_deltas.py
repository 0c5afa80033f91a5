"""moe_plugin.export.deltas against its plain references and against peft's own delta of a stacked expert
adapter; moe_plugin.export.targets' map against peft's nesting (the layout's split and stack:
tests/test_expert_adapters.py)."""

import pytest
import torch

from moe_plugin.expert_adapters import split_experts
from moe_plugin.export.deltas import dense_delta, expert_deltas, expert_deltas_reference


def _stacked(experts=5, r=3, out=7, inp=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r * experts, inp, generator=g), torch.randn(out, r * experts, generator=g)


def test_expert_deltas_match_the_reference():
    a, b = _stacked()
    got, ref = expert_deltas(a, b, 5, 0.5), expert_deltas_reference(a, b, 5, 0.5)
    assert got.shape == (5, 7, 4)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dense_delta(*split_experts(a, b, 5)[2], 0.5), got[2], rtol=1e-6, atol=1e-6)


def test_expert_deltas_equal_peft_and_the_map_names_the_right_parameter():
    from peft import get_peft_model

    from moe_plugin.export.targets import adapter_targets
    from moe_plugin.lora import lora_config
    from moe_plugin.models import MoEPluginForCausalLM, preset_config

    config = preset_config("tiny", attn_res=False)
    lora = lora_config(2, 6, ["q_proj"], ["experts.w1", "experts.w2", "experts.w3"])
    torch.manual_seed(0)
    model = get_peft_model(MoEPluginForCausalLM(config), lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    targets = adapter_targets(config, lora)
    experts = [t for t in targets.values() if t.experts]
    assert len(experts) == 3 * sum(config.to_model_config().is_moe_layer(i) for i in range(config.num_hidden_layers))
    for target in experts:
        module = model.get_submodule(target.module)
        assert target.weight.endswith("." + module.parameter_name)  # the nesting peft chose, not a guess
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        torch.testing.assert_close(
            expert_deltas(a, b, target.experts, target.scaling),
            module.get_delta_weight("default"),
            rtol=1e-6,
            atol=1e-6,
        )
        base = dict(model.named_parameters())[
            "base_model.model." + target.weight.replace("experts.", "experts." + "base_layer." * 3)
        ]
        assert expert_deltas(a, b, target.experts, target.scaling).shape == base.shape


def test_bad_shapes_name_the_adapter():
    a, b = _stacked()
    with pytest.raises(ValueError, match="lora: a stacked expert adapter over 4 experts"):
        expert_deltas(a, b, 4, 1.0)
