"""Configs that cannot work fail when built, and the error names the field."""

import pytest

from moe_plugin.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, VisionConfig


def _model(**kw):
    d = kw.pop("hidden_size", 64)
    parts = dict(
        kda=KDAConfig(d, 2, 32), mla=MLAConfig(d, 2, 32, 32, 16, 8, 16), moe=MoEConfig(d, 8, 2, 32, latent_size=32)
    )
    parts.update(kw)
    return ModelConfig(vocab_size=300, hidden_size=d, num_layers=4, dense_intermediate_size=128, **parts)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: KDAConfig(hidden_size=64, num_heads=3), "KDAConfig.num_heads"),
        (lambda: KDAConfig(hidden_size=64, num_heads=2, head_dim=-4), "KDAConfig.head_dim"),
        (lambda: KDAConfig(hidden_size=64, num_heads=2, gate_form="exp"), "KDAConfig.gate_form"),
        (lambda: KDAConfig(hidden_size=64, num_heads=2, gate_lower_bound=1.0), "KDAConfig.gate_lower_bound"),
        (lambda: MLAConfig(64, 2, 32, 32, 16, -1, 16), "MLAConfig.qk_rope_head_dim"),
        (lambda: MLAConfig(64, 0, 32, 32, 16, 8, 16), "MLAConfig.num_heads"),
        (lambda: MoEConfig(64, num_experts=8, top_k=9, expert_intermediate_size=32), "MoEConfig.top_k"),
        (lambda: MoEConfig(64, 8, 2, -32), "MoEConfig.expert_intermediate_size"),
        (lambda: MoEConfig(64, 8, 2, 32, num_groups=3), "MoEConfig.num_groups"),
        (lambda: MoEConfig(64, 8, 2, 32, num_groups=4, topk_groups=5), "MoEConfig.topk_groups"),
        (lambda: MoEConfig(64, 8, 2, 32, activation="relu"), "MoEConfig.activation"),
        (lambda: VisionConfig(hidden_size=30, num_heads=4), "VisionConfig.num_heads"),
        (lambda: _model(layer_types=["kda"] * 3), "ModelConfig.layer_types"),
        (lambda: _model(layer_types=["kda", "kda", "rnn", "mla"]), "ModelConfig.layer_types"),
        (lambda: _model(moe=MoEConfig(32, 8, 2, 32)), "ModelConfig.moe.hidden_size"),
    ],
)
def test_bad_config_names_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()


def test_defaults_follow_the_three_to_one_schedule():
    cfg = _model()
    assert cfg.layer_types == ["kda", "kda", "kda", "mla"]
    assert KDAConfig(hidden_size=64, num_heads=4).head_dim == 16
    assert MoEConfig(64, 8, 2, 32, num_shared_experts=2).shared_intermediate_size == 64
