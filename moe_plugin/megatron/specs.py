"""megatron-core ModuleSpecs for the model family, and megatron's own ``GPTModel`` built from them.

The model is megatron-core's ``GPTModel`` with its ``TransformerBlock`` and ``TransformerLayer``; only the
submodules are ours (``adapters.py``, ``latent_moe.py``), and each of them is the single-device layer of
``moe_plugin.layers`` with megatron's calling conventions. The block follows ``ModelConfig``'s schedule:
layer i has KDA or Gated DSA attention (``layer_types[i]``) and a dense GLU MLP (``i < first_k_dense``) or the
Stable Latent MoE. There is no position embedding (``position_embedding_type="none"``): KDA carries position.
With Attention Residuals (``ModelConfig.attn_res``) the layers are ``AttnResTransformerLayer`` and the decoder
an ``AttnResTransformerBlock`` (``attn_res_block.py``): thin subclasses that carry the AttnRes state. Without,
the layers are ``CheckpointedTransformerLayer`` (``recompute_layer.py``): megatron's layer with this project's
activation checkpointing, which the AttnRes layer has too.

Spec builders check their preconditions first and raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any, List

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, require
from .adapters import DenseMLP, GatedDSASelfAttention, KDASelfAttention, MegatronRMSNorm
from .attn_res_block import AttnResTransformerLayer, enable_attn_res_block
from .latent_moe import latent_moe_spec, megatron_moe_fields
from .recompute_layer import CheckpointedTransformerLayer

__all__ = [
    "kda_attention_spec",
    "gated_dsa_attention_spec",
    "dense_mlp_spec",
    "moe_mlp_spec",
    "decoder_layer_spec",
    "decoder_block_spec",
    "transformer_config",
    "check_transformer_config",
    "build_gpt_model",
]


def _require_type(value: Any, cls: type, name: str) -> None:
    require(isinstance(value, cls), name, f"must be a {cls.__name__}, got {type(value).__name__}")


def kda_attention_spec(kda: KDAConfig) -> ModuleSpec:
    """``self_attention`` spec of a KDA layer."""
    _require_type(kda, KDAConfig, "kda")
    return ModuleSpec(module=KDASelfAttention, params={"kda": kda})


def gated_dsa_attention_spec(mla: MLAConfig, indexer_loss: bool = False) -> ModuleSpec:
    """``self_attention`` spec of a Gated DSA layer (gated MLA, with the lightning indexer when ``use_indexer``);
    ``indexer_loss``: training forwards keep the indexer's KL loss (``GatedDSASelfAttention.pop_indexer_loss``)."""
    _require_type(mla, MLAConfig, "mla")
    return ModuleSpec(module=GatedDSASelfAttention, params={"mla": mla, "indexer_loss": bool(indexer_loss)})


def dense_mlp_spec(config: ModelConfig) -> ModuleSpec:
    """``mlp`` spec of a dense layer: the GLU MLP of width ``dense_intermediate_size``, the MoE's activation."""
    _require_type(config, ModelConfig, "config")
    require(
        config.dense_intermediate_size > 0,
        "ModelConfig.dense_intermediate_size",
        f"must be positive for a dense layer, got {config.dense_intermediate_size}",
    )
    moe = config.moe
    return ModuleSpec(
        module=DenseMLP,
        params=dict(
            intermediate_size=config.dense_intermediate_size,
            activation=moe.activation,
            situ_beta=moe.situ_beta,
            situ_linear_beta=moe.situ_linear_beta,
        ),
    )


def moe_mlp_spec(moe: MoEConfig) -> ModuleSpec:
    """``mlp`` spec of an MoE layer: ``LatentMoELayer`` (Stable Latent MoE on megatron's dispatcher)."""
    _require_type(moe, MoEConfig, "moe")
    return latent_moe_spec(moe)


def _check_model_config(config: ModelConfig) -> None:
    _require_type(config, ModelConfig, "config")


def decoder_layer_spec(config: ModelConfig, layer_idx: int, indexer_loss: bool = False) -> ModuleSpec:
    """megatron ``TransformerLayer`` spec of layer ``layer_idx`` (0-based) of ``config``'s schedule
    (``indexer_loss``: see ``gated_dsa_attention_spec``)."""
    _check_model_config(config)
    require(
        isinstance(layer_idx, int) and 0 <= layer_idx < config.num_layers,
        "layer_idx",
        f"must be in [0, {config.num_layers}), got {layer_idx!r}",
    )
    if config.layer_types[layer_idx] == "kda":
        attention = kda_attention_spec(config.kda)
    else:
        attention = gated_dsa_attention_spec(config.mla, indexer_loss)
    mlp = moe_mlp_spec(config.moe) if config.is_moe_layer(layer_idx) else dense_mlp_spec(config)
    submodules = TransformerLayerSubmodules(
        input_layernorm=MegatronRMSNorm,
        self_attention=attention,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=MegatronRMSNorm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
    )
    if config.attn_res:  # the same submodules; the layer carries the AttnRes state instead of one residual
        return ModuleSpec(
            module=AttnResTransformerLayer,
            submodules=submodules,
            params={"attn_res_block_size": config.attn_res_block_size},
        )
    return ModuleSpec(module=CheckpointedTransformerLayer, submodules=submodules)


def decoder_block_spec(config: ModelConfig, indexer_loss: bool = False) -> TransformerBlockSubmodules:
    """``TransformerBlockSubmodules``: one layer spec per layer of the schedule, then the final RMSNorm."""
    _check_model_config(config)
    specs: List[ModuleSpec] = [decoder_layer_spec(config, i, indexer_loss) for i in range(config.num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=MegatronRMSNorm)


def transformer_config(config: ModelConfig, **overrides: Any) -> TransformerConfig:
    """The ``TransformerConfig`` of ``config``: sizes, RMSNorm eps, no dropout or bias, the MoE fields that
    ``LatentMoELayer`` needs, fusions off (they are CUDA-only or ``torch.compile``d). ``overrides`` win."""
    _check_model_config(config)
    fields = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.mla.num_heads,
        ffn_hidden_size=config.dense_intermediate_size or config.moe.expert_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **megatron_moe_fields(config.moe),
    )
    fields.update(overrides)
    tc = TransformerConfig(**fields)
    check_transformer_config(tc, config)
    return tc


def check_transformer_config(tc: TransformerConfig, config: ModelConfig) -> None:
    """Raise ValueError naming the ``TransformerConfig`` field that the adapters cannot honour."""
    require(
        tc.num_layers == config.num_layers,
        "TransformerConfig.num_layers",
        f"must equal ModelConfig.num_layers ({config.num_layers}), got {tc.num_layers}",
    )
    require(
        tc.hidden_size == config.hidden_size,
        "TransformerConfig.hidden_size",
        f"must equal ModelConfig.hidden_size ({config.hidden_size}), got {tc.hidden_size}",
    )
    require(
        tc.layernorm_epsilon == config.rms_norm_eps,
        "TransformerConfig.layernorm_epsilon",
        f"must equal ModelConfig.rms_norm_eps ({config.rms_norm_eps}), got {tc.layernorm_epsilon}",
    )
    for name in ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size"):
        require(
            getattr(tc, name) == 1,
            f"TransformerConfig.{name}",
            f"must be 1: the adapted layers are not split across ranks, got {getattr(tc, name)}",
        )
    require(not tc.sequence_parallel, "TransformerConfig.sequence_parallel", "is not supported")
    require(
        tc.bias_dropout_fusion is False,
        "TransformerConfig.bias_dropout_fusion",
        "must be False (the fused version is torch.compile'd and the layers have no bias)",
    )


def build_gpt_model(config: ModelConfig, tc: TransformerConfig = None, indexer_loss: bool = False, **gpt_kwargs: Any):
    """megatron-core's ``GPTModel`` for ``config``: ``decoder_block_spec`` layers, no position embedding,
    input/output embeddings tied iff ``config.tie_word_embeddings``; with ``config.attn_res`` the decoder is an
    ``AttnResTransformerBlock``. indexer_loss: the Gated DSA layers keep their indexer KL loss in training
    forwards (``adapters.indexer_loss_of(model)`` takes it; the caller adds it to the loss).

    Start megatron's parallel state first (``moe_plugin.parallel.distributed.initialize_megatron``): MoE
    layers take their expert-parallel groups from it and build only this rank's experts.
    forward(input_ids ``[B, T]``, position_ids=None, attention_mask=None, packed_seq_params=...) returns logits
    ``[B, T, V]``.
    """
    from megatron.core.models.gpt import GPTModel

    _check_model_config(config)
    tc = transformer_config(config) if tc is None else tc
    check_transformer_config(tc, config)
    kwargs = dict(
        vocab_size=config.vocab_size,
        max_sequence_length=1,  # unused without position embedding
        position_embedding_type="none",
        share_embeddings_and_output_weights=config.tie_word_embeddings,
    )
    kwargs.update(gpt_kwargs)
    model = GPTModel(tc, decoder_block_spec(config, indexer_loss), **kwargs)
    if config.attn_res:
        enable_attn_res_block(model.decoder, config.attn_res_block_size)
    return model
