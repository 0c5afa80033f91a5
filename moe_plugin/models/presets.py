"""Named model sizes: ``tiny`` (trains on 2 CPU cores) and ``k3`` (Kimi K3, docs/architecture.md 1)."""

from __future__ import annotations

from typing import Any, Callable, Dict

from .configuration import MoEPluginConfig
from .k3_vision import K3_VISION_CONFIG, vision_kwargs


def _k3_layer_types():
    # full attention at 1-indexed layers 4, 8, ..., 92 and 93; KDA elsewhere
    full = set(range(4, 93, 4)) | {93}
    return ["mla" if i in full else "kda" for i in range(1, 94)]


def tiny(**overrides: Any) -> Dict[str, Any]:
    """Four layers (3 KDA + 1 gated MLA with an indexer), 8 latent experts top-2, AttnRes on, a tiny ViT."""
    return (
        dict(
            vocab_size=384,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["kda", "kda", "kda", "mla"],
            hidden_act="situ",
            attn_res=True,
            attn_res_block_size=2,
            linear_attn_config=dict(
                num_heads=2,
                head_dim=32,
                short_conv_kernel_size=4,
                gate_lower_bound=-5.0,
                gate_form="k3",
                gate_rank=16,
                chunk_size=32,
            ),
            num_attention_heads=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mla_use_output_gate=True,
            use_dsa_indexer=True,
            index_topk=64,
            index_n_heads=2,
            index_head_dim=16,
            indexer_loss_coeff=1.0,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            routed_expert_hidden_size=32,
            first_k_dense_replace=1,
            intermediate_size=128,
            vision_config=dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_grid=16),
            image_token_id=259,
        )
        | overrides
    )


def k3(**overrides: Any) -> Dict[str, Any]:
    """Kimi K3's published text layout (no DSA indexer, as K3 ships; pass use_dsa_indexer=True for the seed)."""
    return (
        dict(
            vocab_size=163840,
            hidden_size=7168,
            num_hidden_layers=93,
            layer_types=_k3_layer_types(),
            rms_norm_eps=1e-5,
            hidden_act="situ",
            activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0,
            attn_res=True,
            attn_res_block_size=12,
            linear_attn_config=dict(
                num_heads=96,
                head_dim=128,
                short_conv_kernel_size=4,
                gate_lower_bound=-5.0,
                gate_form="k3",
                gate_rank=128,
                chunk_size=64,
            ),
            num_attention_heads=96,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_use_output_gate=True,
            use_dsa_indexer=False,
            index_topk=2048,
            index_n_heads=64,
            index_head_dim=128,
            num_experts=896,
            num_experts_per_token=16,
            num_shared_experts=2,
            moe_intermediate_size=3072,
            routed_expert_hidden_size=3584,
            latent_moe_use_norm=True,
            routed_scaling_factor=1.0,
            moe_renormalize=True,
            num_expert_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            intermediate_size=33792,
            tie_word_embeddings=False,
            vision_config=vision_kwargs(K3_VISION_CONFIG),  # the release's MoonViT-3D (docs/multimodal.md 7)
            image_token_id=163605,
        )
        | overrides
    )


PRESETS: Dict[str, Callable[..., Dict[str, Any]]] = {"tiny": tiny, "k3": k3}


def preset_config(name: str, **overrides: Any) -> MoEPluginConfig:
    """The Hugging Face config of a named preset; keyword arguments override its keys."""
    if name not in PRESETS:
        raise ValueError(f"name: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return MoEPluginConfig(**PRESETS[name](**overrides))
