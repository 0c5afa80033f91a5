"""MoEPluginConfig: what it carries, how the built model follows it, presets, and configs that cannot work."""

import pytest
import torch
from transformers import AutoConfig

import moe_plugin
from moe_plugin.layers.gated_dsa import GatedMLAAttention
from moe_plugin.layers.kda import KDAAttention
from moe_plugin.models import MoEPluginConfig, MoEPluginForCausalLM
from moe_plugin.models.presets import tiny


def test_default_schedule_is_three_kda_to_one_full_attention():
    config = MoEPluginConfig(num_hidden_layers=8)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]


def test_k3_preset_schedule_and_sizes():
    config = moe_plugin.preset_config("k3")
    full = [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert full == list(range(4, 93, 4)) + [93]  # 1-indexed, as docs/architecture.md 1 lists them
    assert config.layer_types.count("linear_attention") == 69
    assert (config.hidden_size, config.num_experts, config.num_experts_per_token) == (7168, 896, 16)
    assert (config.routed_expert_hidden_size, config.moe_intermediate_size) == (3584, 3072)
    assert config.use_dsa_indexer is False and config.hidden_act == "situ" and config.attn_res is True


def test_config_round_trips_through_auto_config(tmp_path):
    config = moe_plugin.preset_config("tiny", hidden_act="swiglu", index_topk=16, num_shared_experts=2)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is MoEPluginConfig
    for key in (
        "layer_types",
        "use_dsa_indexer",
        "index_topk",
        "hidden_act",
        "attn_res",
        "num_experts",
        "routed_expert_hidden_size",
        "num_shared_experts",
        "first_k_dense_replace",
        "linear_attn_config",
        "vision_config",
    ):
        assert getattr(loaded, key) == getattr(config, key), key


def _layer(model, i):
    return model.model.layers[i]


@pytest.mark.parametrize(
    "overrides, check",
    [
        (
            dict(layer_types=["kda", "mla", "kda", "mla"]),
            lambda m: [type(layer.self_attn) for layer in m.model.layers] == [KDAAttention, GatedMLAAttention] * 2,
        ),
        (dict(use_dsa_indexer=False), lambda m: _layer(m, 3).self_attn.indexer is None),
        (
            dict(use_dsa_indexer=True, index_topk=5),
            lambda m: _layer(m, 3).self_attn.indexer is not None and _layer(m, 3).self_attn.config.index_topk == 5,
        ),
        (
            dict(hidden_act="swiglu"),
            lambda m: (
                _layer(m, 1).block_sparse_moe.experts.activation == "swiglu" and _layer(m, 0).mlp.activation == "swiglu"
            ),
        ),
        (
            dict(attn_res=False),
            lambda m: not hasattr(_layer(m, 0), "mlp_res_proj") and not hasattr(m.model, "output_attn_res_proj"),
        ),
        (
            dict(attn_res=True),
            lambda m: hasattr(_layer(m, 0), "mlp_res_proj") and hasattr(m.model, "output_attn_res_proj"),
        ),
        (
            dict(num_experts=6, num_experts_per_token=3),
            lambda m: (
                _layer(m, 1).block_sparse_moe.experts.w1.shape[0] == 6 and _layer(m, 1).block_sparse_moe.top_k == 3
            ),
        ),
        (
            dict(routed_expert_hidden_size=None),
            lambda m: (
                not hasattr(_layer(m, 1).block_sparse_moe, "routed_expert_down_proj")
                and _layer(m, 1).block_sparse_moe.experts.w1.shape[2] == 64
            ),
        ),
        (dict(routed_expert_hidden_size=16), lambda m: _layer(m, 1).block_sparse_moe.experts.w1.shape[2] == 16),
        (dict(num_shared_experts=0), lambda m: not hasattr(_layer(m, 1).block_sparse_moe, "shared_experts")),
        (dict(num_shared_experts=2), lambda m: _layer(m, 1).block_sparse_moe.shared_experts.up_proj.out_features == 64),
        (
            dict(first_k_dense_replace=2),
            lambda m: [hasattr(layer, "mlp") for layer in m.model.layers] == [True, True, False, False],
        ),
        (dict(first_k_dense_replace=0), lambda m: all(hasattr(layer, "block_sparse_moe") for layer in m.model.layers)),
    ],
)
def test_model_follows_config(overrides, check):
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", **overrides))
    assert check(model)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            dict(vision_config=dict(hidden_size=30, num_layers=1, num_heads=4, intermediate_size=8)),
            "vision_config.num_heads",
        ),
        (dict(linear_attn_config=dict(num_heads=3, head_dim=None)), "linear_attn_config.num_heads"),
        (dict(num_experts_per_token=9), "num_experts_per_token"),
        (dict(num_expert_group=3), "num_expert_group"),
        (dict(hidden_size=-64), "hidden_size"),
        (dict(moe_intermediate_size=-1), "moe_intermediate_size"),
        (dict(q_lora_rank=0), "q_lora_rank"),
        (dict(linear_attn_config=dict(num_heads=-2)), "linear_attn_config.num_heads"),
        (dict(num_hidden_layers=3), "layer_types"),
        (dict(first_k_dense_replace=9), "first_k_dense_replace"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(vocab_size=100), "image_token_id"),
    ],
)
def test_config_that_cannot_work_fails_when_built(overrides, key):
    with pytest.raises(ValueError, match=rf"^{key} \("):
        MoEPluginConfig(**tiny(**overrides))


def test_unknown_preset():
    with pytest.raises(ValueError, match="name"):
        moe_plugin.preset_config("k4")


def test_k3_preset_counts_published_parameters_on_meta():
    with torch.device("meta"):
        model = MoEPluginForCausalLM(moe_plugin.preset_config("k3"))
    # docs/architecture.md 1 counts the routing selection bias (a buffer here) with the parameters
    total = sum(p.numel() for p in model.parameters())
    total += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    published = 2_779_484_476_000
    assert abs(total - published) / published < 5e-4, total
    # the per-component figures of the same table
    layer0, layer1, layer3 = (model.model.layers[i] for i in (0, 1, 3))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(layer0.self_attn) == 443_740_384
    assert count(layer3.self_attn) == 232_196_096
    assert count(layer0.mlp) == 726_663_168
    assert count(layer1.block_sparse_moe.experts) == 896 * 33_030_144
    moe_rest = count(layer1.block_sparse_moe) - count(layer1.block_sparse_moe.experts) + 896
    assert moe_rest == 189_927_808
    assert count(model.model.embed_tokens) == count(model.lm_head) == 1_174_405_120
