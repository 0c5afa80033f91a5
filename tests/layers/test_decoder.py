"""The decoder layer composes one attention kind and one MLP kind exactly as written out by hand."""

import pytest
import torch

from moe_plugin.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig
from moe_plugin.layers.attn_res import AttnResStream, PlainStream, attn_res_mix
from moe_plugin.layers.decoder import DecoderLayer


def _config(attn_res):
    d = 32
    return ModelConfig(
        vocab_size=100,
        hidden_size=d,
        num_layers=4,
        kda=KDAConfig(d, 2, 16, chunk_size=8),
        mla=MLAConfig(d, 2, 16, 16, 8, 4, 8, index_topk=4, index_n_heads=2, index_head_dim=8),
        moe=MoEConfig(d, 4, 2, 16, latent_size=16),
        layer_types=["kda", "mla", "kda", "mla"],
        first_k_dense=1,
        dense_intermediate_size=64,
        attn_res=attn_res,
        attn_res_block_size=2,
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layer_idx", [0, 1, 3])
def test_plain_layer_equals_hand_composition(layer_idx):
    torch.manual_seed(layer_idx)
    layer = DecoderLayer(_config(False), layer_idx)
    x = torch.randn(2, 11, 32)
    (out,), load_got, index_loss = layer(PlainStream(x).state())
    assert index_loss is None
    h = x + layer.self_attn(layer.input_layernorm(x))
    if layer.is_moe:
        mlp_out, load = layer.block_sparse_moe(layer.post_attention_layernorm(h))
        assert torch.equal(load_got, load) and float(load.sum()) == 2 * 11 * 2
    else:
        mlp_out = layer.mlp(layer.post_attention_layernorm(h))
        assert load_got is None
    assert _rel(out, h + mlp_out) < 1e-6


def test_attn_res_layer_reads_mixes_and_closes_its_block():
    torch.manual_seed(0)
    layer = DecoderLayer(_config(True), 1)  # layer 1 ends the first block of 2
    with torch.no_grad():
        for p in (layer.self_attention_res_proj.weight, layer.mlp_res_proj.weight):
            p.normal_()
    emb, partial = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    state, _, _ = layer((emb, partial))  # layer 1 is inside a block: the state ends with the partial sum
    eps = layer.input_layernorm.eps
    x = attn_res_mix([emb, partial], layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps)
    a = layer.self_attn(layer.input_layernorm(x))
    x2 = attn_res_mix([emb, partial + a], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
    m, _ = layer.block_sparse_moe(layer.post_attention_layernorm(x2))
    assert len(state) == 2 and state[0] is emb, "the block closes: the embedding and the block's value"
    assert _rel(state[1], partial + a + m) < 1e-6


def test_attn_res_layer_calls_its_mixing_points():
    """ZeRO-3 gathers a weight only when its module is called: every mixing point's proj and norm must be."""
    layer = DecoderLayer(_config(True), 0)
    called = []
    for name in ("self_attention_res_proj", "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm"):
        getattr(layer, name).register_forward_pre_hook(lambda m, args, name=name: called.append(name))
    emb = torch.randn(1, 5, 32)
    state, _, _ = layer(AttnResStream(emb).state())
    assert called == ["self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"]
    assert len(state) == 2 and state[0] is emb, "layer 0 opens a block: the embedding, then the partial sum"


def test_indexer_loss_is_reported_for_mla_layers():
    layer = DecoderLayer(_config(False), 1)
    _, _, index_loss = layer(PlainStream(torch.randn(1, 9, 32)).state(), return_indexer_loss=True)
    assert index_loss is not None and torch.isfinite(index_loss)


def test_layer_index_out_of_range():
    with pytest.raises(ValueError, match="layer_idx"):
        DecoderLayer(_config(False), 4)
