"""The decoder layer composes one attention kind and one MLP kind exactly as written out by hand."""

import pytest
import torch

from moe_plugin.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig
from moe_plugin.layers.attn_res import AttnResStream, PlainStream, attn_res_mix
from moe_plugin.layers.decoder import DecoderLayer


def _config(attn_res):
    d = 32
    return ModelConfig(vocab_size=100, hidden_size=d, num_layers=4, kda=KDAConfig(d, 2, 16, chunk_size=8),
                       mla=MLAConfig(d, 2, 16, 16, 8, 4, 8, index_topk=4, index_n_heads=2, index_head_dim=8),
                       moe=MoEConfig(d, 4, 2, 16, latent_size=16), layer_types=["kda", "mla", "kda", "mla"],
                       first_k_dense=1, dense_intermediate_size=64, attn_res=attn_res, attn_res_block_size=2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layer_idx", [0, 1, 3])
def test_plain_layer_equals_hand_composition(layer_idx):
    torch.manual_seed(layer_idx)
    layer = DecoderLayer(_config(False), layer_idx)
    x = torch.randn(2, 11, 32)
    stream = PlainStream(x)
    aux = layer(stream)
    h = x + layer.self_attn(layer.input_layernorm(x))
    if layer.is_moe:
        mlp_out, load = layer.block_sparse_moe(layer.post_attention_layernorm(h))
        assert torch.equal(aux.expert_load, load) and float(load.sum()) == 2 * 11 * 2
    else:
        mlp_out = layer.mlp(layer.post_attention_layernorm(h))
        assert aux.expert_load is None
    assert _rel(stream.read(), h + mlp_out) < 1e-6


def test_attn_res_layer_reads_mixes_and_closes_its_block():
    torch.manual_seed(0)
    layer = DecoderLayer(_config(True), 1)  # layer 1 ends the first block of 2
    with torch.no_grad():
        for p in (layer.self_attention_res_proj.weight, layer.mlp_res_proj.weight):
            p.normal_()
    emb, partial = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    stream = AttnResStream(emb)
    stream.partial = partial
    layer(stream)
    eps = layer.input_layernorm.eps
    x = attn_res_mix([emb, partial], layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps)
    a = layer.self_attn(layer.input_layernorm(x))
    x2 = attn_res_mix([emb, partial + a], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
    m, _ = layer.block_sparse_moe(layer.post_attention_layernorm(x2))
    assert stream.partial is None and len(stream.blocks) == 2
    assert _rel(stream.blocks[1], partial + a + m) < 1e-6


def test_indexer_loss_is_reported_for_mla_layers():
    layer = DecoderLayer(_config(False), 1)
    aux = layer(PlainStream(torch.randn(1, 9, 32)), return_indexer_loss=True)
    assert aux.indexer_loss is not None and torch.isfinite(aux.indexer_loss)


def test_layer_index_out_of_range():
    with pytest.raises(ValueError, match="layer_idx"):
        DecoderLayer(_config(False), 4)
