"""The name table and layout rules of moe_plugin.weights.names, against names and shapes written out by hand."""

import pytest
import torch

from moe_plugin.models import MoEPluginForCausalLM, preset_config
from moe_plugin.weights import names


def model_config(**overrides):
    return preset_config("tiny", attn_res=False, vision_config=None, image_token_id=None, **overrides).to_model_config()


def test_every_hf_tensor_round_trips_through_megatron_names():
    config = model_config()
    hf_names = list(
        MoEPluginForCausalLM(
            preset_config("tiny", attn_res=False, vision_config=None, image_token_id=None)
        ).state_dict()
    )
    for name in hf_names:
        assert names.megatron_to_hf_name(names.hf_to_megatron_name(name, config), config) == name
    assert names.hf_to_megatron_name("model.layers.2.block_sparse_moe.experts.w2") == "decoder.layers.2.mlp.experts.w2"
    assert (
        names.hf_to_megatron_name("model.layers.0.post_attention_layernorm.weight")
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    # layer 0 is dense in the tiny preset: its mlp is "mlp", the others' "block_sparse_moe"
    assert (
        names.megatron_to_hf_name("decoder.layers.0.mlp.up_proj.weight", config) == "model.layers.0.mlp.up_proj.weight"
    )
    assert (
        names.megatron_to_hf_name("decoder.layers.1.mlp.gate.weight", config)
        == "model.layers.1.block_sparse_moe.gate.weight"
    )
    with pytest.raises(ValueError, match=r"^name: 'decoder\.rotary_pos_emb\.inv_freq' matches no megatron prefix"):
        names.megatron_to_hf_name("decoder.rotary_pos_emb.inv_freq", config)
    with pytest.raises(ValueError, match="^config: must be a ModelConfig"):
        names.megatron_to_hf_name("decoder.final_layernorm.weight", None)


def test_target_names_as_hf_names():
    config = model_config()
    assert names.to_hf_name("language_model.model.norm.weight", "hf", config) == "model.norm.weight"
    assert names.to_hf_name("vision_tower.pos_embed", "hf", config) == "vision_tower.pos_embed"
    assert names.to_hf_name("output_layer.weight", "megatron", config) == "lm_head.weight"
    assert names.base_name("decoder.layers.1.mlp.experts.base_layer.base_layer.w1") == "decoder.layers.1.mlp.experts.w1"


def test_expert_names():
    assert names.is_expert_tensor("decoder.layers.3.mlp.experts.w3")
    assert not names.is_expert_tensor("decoder.layers.3.mlp.experts.lora_A.weight")
    assert names.expert_layer("decoder.layers.12.mlp.experts.w1") == 12
    assert names.is_stacked_expert("model.layers.1.block_sparse_moe.experts.w2")
    assert not names.is_stacked_expert("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight")
    assert (
        names.k3_expert_name("model.layers.1.block_sparse_moe.experts.w2", 7)
        == "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    )
    assert names.parse_k3_expert("language_model.model.layers.3.block_sparse_moe.experts.11.w1.weight") == (
        "language_model.model.layers.3.block_sparse_moe.experts.w1",
        11,
    )
    assert names.parse_k3_expert("model.layers.3.block_sparse_moe.experts.w1") is None
    assert names.k3_tensor_names("model.layers.1.block_sparse_moe.experts.w3", (8, 32, 32), range(2, 4)) == [
        "model.layers.1.block_sparse_moe.experts.2.w3.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    ]
    assert names.k3_tensor_names("model.norm.weight", (64,)) == ["model.norm.weight"]


def test_mtp_and_indexer_names():
    assert names.is_mtp("model.layers.4.input_layernorm.weight", num_layers=4)
    assert names.is_mtp("language_model.model.layers.61.self_attn.q_proj.weight", num_layers=61)
    assert not names.is_mtp("model.layers.3.input_layernorm.weight", num_layers=4)
    assert names.is_indexer_tensor("model.layers.3.self_attn.indexer.wq_b.weight")


@pytest.mark.parametrize("heads, stored", [(2, 128), (96, 128), (128, 128), (129, 256)])
def test_a_log_padding_length(heads, stored):
    assert names.a_log_padded_length(heads) == stored


def test_k3_shapes_that_fit():
    a_log = "model.layers.0.self_attn.A_log"
    conv = "model.layers.0.self_attn.q_conv1d.weight"
    assert names.k3_shape_fits(a_log, (128,), (2,)) is None
    assert names.k3_shape_fits(a_log, (1, 1, 128, 1), (2,)) is None
    assert "at least 4 entries" in names.k3_shape_fits(a_log, (2, 64), (4,))  # not a vector
    assert "at least 4 entries" in names.k3_shape_fits(a_log, (3,), (4,))
    assert names.k3_shape_fits(conv, (64, 1, 4), (64, 4)) is None
    assert names.k3_shape_fits(conv, (32, 1, 8), (64, 4)) == ""  # same elements, other channels
    assert names.k3_shape_fits("model.norm.weight", (64,), (64,)) is None
    assert names.k3_shape_fits("model.norm.weight", (63,), (64,)) == ""
    assert names.needs_k3_conversion(a_log, (128,), (2,)) and not names.needs_k3_conversion(a_log, (2,), (2,))
    assert not names.needs_k3_conversion(conv, (64, 1, 4), (64, 4))


def test_k3_tensor_conversions_both_ways():
    heads = torch.tensor([0.5, -1.5])
    padded = names.tensor_to_k3("model.layers.0.self_attn.A_log", heads)
    assert padded.shape == (128,) and torch.equal(padded[:2], heads) and not padded[2:].any()
    from_k3 = names.tensor_from_k3("model.layers.0.self_attn.A_log", padded.reshape(1, 1, 128, 1), (2,))
    assert torch.equal(from_k3, heads)
    with pytest.raises(ValueError, match=r"A_log: expected a padded vector of at least 2 entries.*got shape \[1\]"):
        names.tensor_from_k3("model.layers.0.self_attn.A_log", torch.zeros(1), (2,))
    conv = torch.arange(12.0).reshape(3, 4)
    stored = names.tensor_to_k3("model.layers.0.self_attn.k_conv1d.weight", conv)
    assert stored.shape == (3, 1, 4) and torch.equal(stored[:, 0], conv)
    assert torch.equal(names.tensor_from_k3("model.layers.0.self_attn.k_conv1d.weight", stored, (3, 4)), conv)
    norm = torch.ones(4)
    assert names.tensor_to_k3("model.norm.weight", norm) is norm


def test_quantised_tensors_are_found_by_name_or_dtype():
    found = names.quantised_tensors(
        {
            "a.experts.0.w1.weight_packed": "uint8",
            "a.experts.0.w1.weight_scale": "float32",
            "b.weight": "float8_e8m0fnu",
            "c.weight_blocks": "bfloat16",
            "d.weight": "bfloat16",
            "e.weight": "float32",
        }
    )
    assert found == ["a.experts.0.w1.weight_packed", "a.experts.0.w1.weight_scale", "b.weight", "c.weight_blocks"]
