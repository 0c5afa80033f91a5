"""The Hugging Face config of the model family, with K3's key names where K3 has one.

``MoEPluginConfig`` is a thin ``PretrainedConfig`` over the validated dataclasses of
``moe_plugin.config``: it stores flat, JSON-friendly keys, and ``to_model_config()`` builds (and so
validates) the dataclasses the layers take. Validation runs when the config is built, and errors name
the Hugging Face key (with the dataclass field in brackets).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from transformers import PretrainedConfig

from ..config import HF_MODEL_TYPE, KDAConfig, MLAConfig, ModelConfig, MoEConfig, VisionConfig, default_layer_types

# dataclass field -> Hugging Face key, so that errors name what the user actually wrote
_HF_KEY = {
    "ModelConfig.num_layers": "num_hidden_layers",
    "ModelConfig.first_k_dense": "first_k_dense_replace",
    "ModelConfig.dense_intermediate_size": "intermediate_size",
    "ModelConfig.vision.out_hidden_size": "hidden_size",
    "KDAConfig.num_heads": "linear_attn_config.num_heads",
    "KDAConfig.head_dim": "linear_attn_config.head_dim",
    "KDAConfig.conv_size": "linear_attn_config.short_conv_kernel_size",
    "KDAConfig.gate_lower_bound": "linear_attn_config.gate_lower_bound",
    "KDAConfig.gate_form": "linear_attn_config.gate_form",
    "KDAConfig.gate_rank": "linear_attn_config.gate_rank",
    "KDAConfig.chunk_size": "linear_attn_config.chunk_size",
    "MLAConfig.num_heads": "num_attention_heads",
    "MLAConfig.output_gate": "mla_use_output_gate",
    "MLAConfig.use_indexer": "use_dsa_indexer",
    "MoEConfig.num_experts": "num_experts",
    "MoEConfig.top_k": "num_experts_per_token",
    "MoEConfig.expert_intermediate_size": "moe_intermediate_size",
    "MoEConfig.latent_size": "routed_expert_hidden_size",
    "MoEConfig.latent_norm": "latent_moe_use_norm",
    "MoEConfig.activation": "hidden_act",
    "MoEConfig.situ_beta": "activation_situ_beta",
    "MoEConfig.situ_linear_beta": "activation_situ_linear_beta",
    "MoEConfig.renormalize": "moe_renormalize",
    "MoEConfig.num_groups": "num_expert_group",
    "MoEConfig.topk_groups": "topk_group",
}
# fields whose Hugging Face key has the same name (MLA's ranks and dims, the model's own sizes)
_SAME_NAME = {
    "MLAConfig": (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
    ),
    "MoEConfig": ("num_shared_experts", "routed_scaling_factor", "expert_format"),
    "ModelConfig": ("vocab_size", "layer_types", "attn_res", "attn_res_block_size", "image_token_id"),
}


def hf_key(field: str) -> str:
    """The Hugging Face key behind a dataclass field name such as ``"MoEConfig.top_k"``."""
    owner, _, name = field.partition(".")
    if field in _HF_KEY:
        return _HF_KEY[field]
    if name in _SAME_NAME.get(owner, ()):
        return name
    if name == "hidden_size" and owner != "VisionConfig":
        return "hidden_size"  # every text part takes the model's hidden size
    if owner == "VisionConfig":
        return f"vision_config.{name}"
    return field


_HF_LAYER_TYPE = {"kda": "linear_attention", "mla": "full_attention"}
_LAYER_KIND = {v: k for k, v in _HF_LAYER_TYPE.items()}


class MoEPluginConfig(PretrainedConfig):
    model_type = HF_MODEL_TYPE
    keys_to_ignore_at_inference = ["cache"]
    # model_type -> the subclass that reads another layout of this family (k3_config registers "kimi_k3"), so that
    # MoEPluginConfig.from_pretrained of a K3 directory (the models' config_class) reads it in its own layout
    # rather than taking its outer keys as this layout's
    LAYOUTS = {}

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], **kwargs):
        layout = MoEPluginConfig.LAYOUTS.get(config_dict.get("model_type"))
        if layout is not None and not issubclass(cls, layout):
            return layout.from_dict(config_dict, **kwargs)
        return super().from_dict(config_dict, **kwargs)

    def __init__(
        self,
        vocab_size: int = 384,
        hidden_size: int = 64,
        num_hidden_layers: int = 4,
        layer_types: Optional[List[str]] = None,
        rms_norm_eps: float = 1e-5,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        attn_res: bool = False,
        attn_res_block_size: int = 12,
        linear_attn_config: Optional[Dict[str, Any]] = None,
        num_attention_heads: int = 2,
        q_lora_rank: int = 32,
        kv_lora_rank: int = 32,
        qk_nope_head_dim: int = 16,
        qk_rope_head_dim: int = 8,
        v_head_dim: int = 16,
        mla_use_output_gate: bool = True,
        use_dsa_indexer: bool = True,
        index_topk: int = 2048,
        index_n_heads: int = 2,
        index_head_dim: int = 16,
        num_experts: int = 8,
        num_experts_per_token: int = 2,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 32,
        routed_expert_hidden_size: Optional[int] = 32,
        latent_moe_use_norm: bool = True,
        routed_scaling_factor: float = 1.0,
        moe_renormalize: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        first_k_dense_replace: int = 1,
        intermediate_size: int = 128,
        expert_format: str = "dense",
        vision_config: Optional[Dict[str, Any]] = None,
        image_token_id: Optional[int] = None,
        initializer_range: float = 0.02,
        indexer_loss_coeff: float = 0.0,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        # stored with transformers' layer-type names (which it validates); "kda"/"mla" are accepted too
        kinds = list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)
        self.layer_types = [_HF_LAYER_TYPE.get(k, k) for k in kinds]
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.attn_res = attn_res
        self.attn_res_block_size = attn_res_block_size
        self.linear_attn_config = dict(
            num_heads=2,
            head_dim=32,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
            gate_form="k3",
            gate_rank=None,
            chunk_size=64,
        )
        self.linear_attn_config.update(linear_attn_config or {})
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_output_gate = mla_use_output_gate
        self.use_dsa_indexer = use_dsa_indexer
        self.index_topk = index_topk
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_renormalize = moe_renormalize
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.first_k_dense_replace = first_k_dense_replace
        self.intermediate_size = intermediate_size
        self.expert_format = expert_format
        self.vision_config = dict(vision_config) if vision_config is not None else None
        self.image_token_id = image_token_id
        self.initializer_range = initializer_range
        self.indexer_loss_coeff = indexer_loss_coeff
        # Validate before transformers' own checks run in super().__init__, so that a config that cannot
        # work fails when it is built with a ValueError naming our key (not a strict-dataclass error).
        self.tie_word_embeddings = tie_word_embeddings
        self.to_model_config()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The validated dataclasses the layers take; raises ValueError naming the Hugging Face key."""
        try:
            return self._build_model_config()
        except ValueError as err:
            field, _, message = str(err).partition(": ")
            key = hf_key(field)
            raise ValueError(f"{key} ({field}): {message}" if key != field else str(err)) from None

    def _build_model_config(self) -> ModelConfig:
        d = self.hidden_size
        lin = self.linear_attn_config
        kda = KDAConfig(
            hidden_size=d,
            num_heads=lin["num_heads"],
            head_dim=lin.get("head_dim"),
            conv_size=lin["short_conv_kernel_size"],
            gate_form=lin.get("gate_form", "k3"),
            gate_lower_bound=lin["gate_lower_bound"],
            gate_rank=lin.get("gate_rank"),
            chunk_size=lin.get("chunk_size", 64),
            norm_eps=self.rms_norm_eps,
        )
        mla = MLAConfig(
            hidden_size=d,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            output_gate=self.mla_use_output_gate,
            use_indexer=self.use_dsa_indexer,
            index_topk=self.index_topk,
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            norm_eps=self.rms_norm_eps,
        )
        moe = MoEConfig(
            hidden_size=d,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_token,
            expert_intermediate_size=self.moe_intermediate_size,
            latent_size=self.routed_expert_hidden_size,
            latent_norm=self.latent_moe_use_norm,
            num_shared_experts=self.num_shared_experts,
            activation=self.hidden_act,
            situ_beta=self.activation_situ_beta,
            situ_linear_beta=self.activation_situ_linear_beta,
            routed_scaling_factor=self.routed_scaling_factor,
            renormalize=self.moe_renormalize,
            num_groups=self.num_expert_group,
            topk_groups=self.topk_group,
            norm_eps=self.rms_norm_eps,
            expert_format=self.expert_format,
        )
        vision = None
        if self.vision_config is not None:
            vision = VisionConfig(**{"out_hidden_size": d, "norm_eps": self.rms_norm_eps, **self.vision_config})
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=d,
            num_layers=self.num_hidden_layers,
            kda=kda,
            mla=mla,
            moe=moe,
            layer_types=[_LAYER_KIND.get(t, t) for t in self.layer_types] if self.layer_types is not None else None,
            first_k_dense=self.first_k_dense_replace,
            dense_intermediate_size=self.intermediate_size,
            attn_res=self.attn_res,
            attn_res_block_size=self.attn_res_block_size,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            vision=vision,
            image_token_id=self.image_token_id,
        )
