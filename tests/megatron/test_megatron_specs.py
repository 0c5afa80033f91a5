"""Spec builders, adapters, the name table and expert-adapter slicing, in one process (no megatron groups needed).

The multi-process model checks are in test_megatron_model.py.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_layer import TransformerLayer
from peft import LoraConfig, inject_adapter_in_model

from moe_plugin.expert_adapters import adapter_factor, slice_experts
from moe_plugin.layers.gated_dsa import GatedMLAAttention
from moe_plugin.layers.kda import KDAAttention
from moe_plugin.layers.mlp import GLUMLP
from moe_plugin.layers.stacked_experts import StackedExperts
from moe_plugin.megatron import specs
from moe_plugin.megatron.adapters import (
    DenseMLP,
    GatedDSASelfAttention,
    KDASelfAttention,
    MegatronRMSNorm,
    packed_cu_seqlens,
)
from moe_plugin.megatron.attn_res_block import AttnResTransformerLayer
from moe_plugin.megatron.latent_moe import LatentMoELayer
from moe_plugin.megatron.recompute_layer import CheckpointedTransformerLayer
from moe_plugin.megatron.weights import NAME_TABLE, hf_to_megatron_name, megatron_to_hf_name
from moe_plugin.models.modeling import MoEPluginForCausalLM
from moe_plugin.models.presets import preset_config
from moe_plugin.testing.megatron_loading import load_hf_checkpoint

TOL = 1e-6


def model_config(**overrides):
    base = dict(attn_res=False, vision_config=None, image_token_id=None)
    return preset_config("tiny", **(base | overrides)).to_model_config()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_block_spec_follows_the_schedule():
    config = model_config(num_hidden_layers=5, layer_types=["kda", "mla", "kda", "kda", "mla"], first_k_dense_replace=2)
    block = specs.decoder_block_spec(config)
    assert block.layer_norm is MegatronRMSNorm and len(block.layer_specs) == 5
    attention = [s.submodules.self_attention.module for s in block.layer_specs]
    mlp = [s.submodules.mlp.module for s in block.layer_specs]
    # megatron's layer with this project's activation checkpointing (megatron/recompute_layer.py)
    assert all(
        s.module is CheckpointedTransformerLayer and issubclass(s.module, TransformerLayer) for s in block.layer_specs
    )
    assert attention == [
        KDASelfAttention,
        GatedDSASelfAttention,
        KDASelfAttention,
        KDASelfAttention,
        GatedDSASelfAttention,
    ]
    assert mlp == [DenseMLP, DenseMLP, LatentMoELayer, LatentMoELayer, LatentMoELayer]
    assert block.layer_specs[0].submodules.mlp.params["intermediate_size"] == config.dense_intermediate_size
    assert block.layer_specs[4].submodules.self_attention.params["mla"] is config.mla


def test_attn_res_block_spec_uses_the_attn_res_layer_with_the_same_submodules():
    plain = specs.decoder_block_spec(model_config())
    config = model_config(attn_res=True, attn_res_block_size=3)
    block = specs.decoder_block_spec(config, indexer_loss=True)
    assert all(
        s.module is AttnResTransformerLayer and s.params == {"attn_res_block_size": 3} for s in block.layer_specs
    )
    assert [s.submodules for s in block.layer_specs] == [s.submodules for s in plain.layer_specs[:3]] + [
        block.layer_specs[3].submodules
    ]
    assert block.layer_specs[3].submodules.self_attention.params["indexer_loss"] is True
    assert plain.layer_specs[3].submodules.self_attention.params["indexer_loss"] is False


def test_transformer_config_has_no_positions_dropout_or_fusions():
    config = model_config()
    tc = specs.transformer_config(config)
    assert (tc.hidden_size, tc.num_layers, tc.layernorm_epsilon) == (64, 4, config.rms_norm_eps)
    assert tc.hidden_dropout == 0 and not tc.bias_dropout_fusion and tc.moe_token_dispatcher_type == "alltoall"
    assert tc.num_moe_experts == 8 and tc.moe_router_topk == 2


@pytest.mark.parametrize(
    "call, field",
    [
        (
            lambda: AttnResTransformerLayer(specs.transformer_config(model_config()), None, attn_res_block_size=0),
            "attn_res_block_size",
        ),
        (lambda: specs.decoder_layer_spec(model_config(), 4), "layer_idx"),
        (lambda: specs.kda_attention_spec(model_config().mla), "kda"),
        (lambda: specs.gated_dsa_attention_spec(model_config().kda), "mla"),
        (lambda: specs.moe_mlp_spec(model_config().kda), "moe"),
        (lambda: specs.decoder_block_spec({"num_layers": 4}), "config"),
        (
            lambda: specs.dense_mlp_spec(model_config(first_k_dense_replace=0, intermediate_size=0)),
            "ModelConfig.dense_intermediate_size",
        ),
        (
            lambda: specs.transformer_config(model_config(), tensor_model_parallel_size=2),
            "TransformerConfig.tensor_model_parallel_size",
        ),
        (
            lambda: specs.transformer_config(model_config(), layernorm_epsilon=1e-6),
            "TransformerConfig.layernorm_epsilon",
        ),
        (
            lambda: specs.transformer_config(model_config(), bias_dropout_fusion=True),
            "TransformerConfig.bias_dropout_fusion",
        ),
    ],
)
def test_preconditions_name_the_field(call, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        call()


def _packed(cu, **kw):
    return PackedSeqParams(qkv_format=kw.pop("qkv_format", "thd"), cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw)


@pytest.mark.parametrize(
    "params, batch, field",
    [
        (_packed(torch.tensor([0, 3, 8])), 2, "packed_seq_params"),
        (_packed(torch.tensor([0, 3, 8]), qkv_format="sbhd"), 1, "packed_seq_params.qkv_format"),
        (
            _packed(torch.tensor([0, 3, 8]), cu_seqlens_q_padded=torch.tensor([0, 4, 8])),
            1,
            "packed_seq_params.cu_seqlens_q_padded",
        ),
        (PackedSeqParams(qkv_format="thd"), 1, "packed_seq_params.cu_seqlens_q"),
    ],
)
def test_packed_seq_params_checks(params, batch, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        packed_cu_seqlens(params, batch)


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_attention_adapters_equal_the_layers_sequence_first_and_packed(kind):
    config = model_config()
    tc = specs.transformer_config(config)
    torch.manual_seed(0)
    if kind == "kda":
        adapter, layer = KDASelfAttention(tc, config.kda, layer_number=1), KDAAttention(config.kda)
    else:
        adapter, layer = GatedDSASelfAttention(tc, config.mla, layer_number=4), GatedMLAAttention(config.mla)
    layer.load_state_dict(adapter.state_dict())
    x = torch.randn(2, 12, 64)
    out, bias = adapter(x.transpose(0, 1).contiguous(), attention_mask=None)
    assert bias is None and out.shape == (12, 2, 64)
    assert rel(out.transpose(0, 1), layer(x)) < TOL
    cu = torch.tensor([0, 5, 12])
    packed, _ = adapter(x[:1].transpose(0, 1), packed_seq_params=_packed(cu))
    assert rel(packed.transpose(0, 1), layer(x[:1], cu_seqlens=cu)) < TOL
    assert rel(packed.transpose(0, 1), layer(x[:1])) > 1e-3, "premise: the boundary must matter"
    with pytest.raises(ValueError, match="^inference_context"):
        adapter(x.transpose(0, 1), inference_context=object())


def test_dense_mlp_adapter_equals_the_glu_mlp():
    config = model_config()
    mlp = DenseMLP(specs.transformer_config(config), config.dense_intermediate_size, activation="situ")
    reference = GLUMLP(64, config.dense_intermediate_size, activation="situ")
    reference.load_state_dict(mlp.state_dict())
    x = torch.randn(5, 2, 64)
    out, bias = mlp(x, padding_mask=None)
    assert bias is None and rel(out, reference(x)) < TOL


def test_name_table_round_trips_every_hf_tensor():
    config = model_config()
    names = list(
        MoEPluginForCausalLM(
            preset_config("tiny", attn_res=False, vision_config=None, image_token_id=None)
        ).state_dict()
    )
    assert len({hf for hf, _, _ in NAME_TABLE}) == len(NAME_TABLE)
    for name in names:
        mg = hf_to_megatron_name(name, config)
        assert megatron_to_hf_name(mg, config) == name, (name, mg)
    assert hf_to_megatron_name("model.layers.1.block_sparse_moe.experts.w1") == "decoder.layers.1.mlp.experts.w1"
    assert megatron_to_hf_name("decoder.layers.0.mlp.up_proj.weight", config) == "model.layers.0.mlp.up_proj.weight"
    assert megatron_to_hf_name("decoder.final_layernorm.weight", config) == "model.norm.weight"
    assert hf_to_megatron_name("lm_head.weight") == "output_layer.weight"
    assert hf_to_megatron_name("model.embed_tokens.weight") == "embedding.word_embeddings.weight"
    with pytest.raises(ValueError, match="^name"):
        hf_to_megatron_name("model.layers.0.mlp.up_proj.weight", model_config(first_k_dense_replace=0))
    with pytest.raises(ValueError, match="^name"):
        megatron_to_hf_name("decoder.rotary_pos_emb.inv_freq", config)


def test_load_refuses_a_directory_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="^path"):
        load_hf_checkpoint(torch.nn.Module(), str(tmp_path), model_config())


def test_expert_adapter_slice_gives_peft_the_local_experts_deltas():
    """peft's own delta weights: a local stack with sliced adapters equals the full stack's experts 2..5."""
    experts, r = 8, 3
    full, local = StackedExperts(experts, 6, 5), StackedExperts(4, 6, 5)
    lora = LoraConfig(r=r, lora_alpha=6, target_parameters=["w1", "w2"])
    holder_full, holder_local = torch.nn.ModuleDict({"experts": full}), torch.nn.ModuleDict({"experts": local})
    inject_adapter_in_model(lora, holder_full)
    inject_adapter_in_model(lora, holder_local)
    torch.manual_seed(0)
    local_params = dict(holder_local.named_parameters())
    with torch.no_grad():
        for name, p in holder_full.named_parameters():
            if ".lora_" in name:
                p.normal_()
                local_params[name].copy_(slice_experts(p, adapter_factor(name), 2, 6, experts))
    wrappers = [(m, n) for n, m in holder_full.named_modules() if hasattr(m, "get_delta_weight")]
    assert len(wrappers) == 2
    local_modules = dict(holder_local.named_modules())
    for module, name in wrappers:
        want = module.get_delta_weight("default")[2:6]
        got = local_modules[name].get_delta_weight("default")
        assert got.shape == want.shape and rel(got, want) < TOL, name
