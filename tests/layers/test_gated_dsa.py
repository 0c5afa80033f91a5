"""GatedMLAAttention: decoding with a cache, packing, top-k semantics, the indexer loss, K3 parameter count."""

import pytest
import torch

from moe_plugin.config import MLAConfig
from moe_plugin.layers.gated_dsa import GatedMLAAttention, MLACache
from moe_plugin.ops.dsa import indexer_topk


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def config(**kw):
    base = dict(
        hidden_size=32,
        num_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        use_indexer=True,
        index_topk=3,
        index_n_heads=8,
        index_head_dim=8,
    )
    base.update(kw)
    return MLAConfig(**base)


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    return GatedMLAAttention(config(**kw)).double()


def hidden(B=2, T=12, seed=1):
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("use_indexer", [True, False])
def test_cache_decoding_equals_full_forward(use_indexer):
    attn, x = layer(use_indexer=use_indexer), hidden()
    full = attn(x)
    cache = MLACache()
    parts = [attn(x[:, :4], cache=cache)]  # a prefill, then one token at a time
    parts += [attn(x[:, t : t + 1], cache=cache) for t in range(4, 12)]
    assert cache.length == 12 and cache.k_rope.shape == (2, 12, 4)
    assert (cache.index_keys is not None) == use_indexer
    assert rel(torch.cat(parts, dim=1), full) <= 1e-5


def test_topk_at_least_T_equals_indexer_off():
    sparse = layer(index_topk=12)
    dense = GatedMLAAttention(config(use_indexer=False)).double()
    missing = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert all(key.startswith("indexer.") for key in missing.unexpected_keys) and not missing.missing_keys
    x = hidden()
    assert rel(sparse(x), dense(x)) < 1e-12
    assert rel(layer(index_topk=3)(x), dense(x)) > 1e-3  # with top-k < T the selection matters


def test_warmup_attends_densely():
    attn, x = layer(index_topk=2), hidden()
    dense = GatedMLAAttention(config(use_indexer=False)).double()
    dense.load_state_dict(attn.state_dict(), strict=False)
    attn.indexer_warmup = True
    out, loss = attn(x, return_indexer_loss=True)
    assert rel(out, dense(x)) < 1e-12 and torch.isfinite(loss)


def test_only_selected_keys_matter():
    attn, x = layer(index_topk=3), hidden(B=1, T=10)
    cache = MLACache()
    attn(x[:, :9], cache=cache)
    with torch.no_grad():  # the indices the last query will use (scale does not change the order)
        q_latent = attn.q_a_layernorm(attn.q_a_proj(x[:, 9:]))
        qi, ki, w = attn.indexer(x[:, 9:], q_latent)
        keys = torch.cat([cache.index_keys, ki], dim=1)
        chosen = set(indexer_topk(qi, keys, w, 3, query_offset=9)[0, 0].tolist())
    unchosen = sorted(set(range(9)) - chosen)
    picked = sorted(chosen - {9})

    def last_output(change):
        c = MLACache(cache.c_kv.clone(), cache.k_rope.clone(), cache.index_keys.clone())
        c.c_kv[:, change] += 3.0
        c.k_rope[:, change] -= 2.0
        return attn(x[:, 9:], cache=c)

    base = last_output([])
    assert torch.equal(last_output(unchosen), base)
    assert not torch.allclose(last_output(picked[:1]), base)


def test_packed_sequences_equal_each_alone():
    attn = layer(index_topk=3)
    lengths = [5, 1, 7]
    x = hidden(B=1, T=sum(lengths))
    cu = torch.tensor([0, 5, 6, 13])
    packed, loss = attn(x, cu_seqlens=cu, return_indexer_loss=True)
    alone = torch.cat([attn(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert rel(packed, alone) < 1e-12 and torch.isfinite(loss)


def test_indexer_loss_trains_only_the_indexer():
    attn, x = layer(), hidden()
    x.requires_grad_(True)
    out, loss = attn(x, return_indexer_loss=True)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss > 0
    loss.backward()
    for name, p in attn.named_parameters():
        reached = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert reached == name.startswith("indexer."), name
    assert x.grad is None  # the indexer's inputs are detached
    attn.zero_grad()
    out.sum().backward()  # and the attention output does not train the indexer
    assert all(p.grad is None or not p.grad.any() for p in attn.indexer.parameters())
    assert layer(use_indexer=False)(x, return_indexer_loss=True)[1] is None


def test_names_and_k3_parameter_count():
    k3 = dict(
        hidden_size=7168,
        num_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        output_gate=True,
    )
    with torch.device("meta"):
        off = GatedMLAAttention(MLAConfig(**k3, use_indexer=False))
        on = GatedMLAAttention(MLAConfig(**k3, use_indexer=True))
    assert sum(p.numel() for p in off.parameters()) == 232_196_096
    extra = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64  # wq_b, wk, k_norm, weights_proj
    assert sum(p.numel() for p in on.parameters()) == 232_196_096 + extra
    names = {n for n, _ in on.named_parameters()}
    assert {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "g_proj.weight",
        "o_proj.weight",
        "indexer.wq_b.weight",
        "indexer.wk.weight",
        "indexer.k_norm.weight",
        "indexer.k_norm.bias",
        "indexer.weights_proj.weight",
    } == names


def test_init_std():
    torch.manual_seed(0)
    attn = GatedMLAAttention(config(hidden_size=256, q_lora_rank=128))
    assert abs(float(attn.q_a_proj.weight.detach().std()) - 0.02) < 2e-3


def test_bad_input():
    attn, x = layer(), hidden(B=1, T=4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attn(x, cu_seqlens=torch.tensor([0, 4]), cache=MLACache())
    with pytest.raises(ValueError, match="hidden_states"):
        attn(x[..., :8])
    cache = MLACache()
    attn(x, cache=cache)
    with pytest.raises(ValueError, match="cache.c_kv"):
        attn(hidden(B=2, T=1), cache=cache)


@pytest.mark.parametrize("use_indexer", [True, False])
def test_left_padded_prefill_equals_each_row_alone(use_indexer):
    """Padded keys are never attended or selected (top-k 3 < every prompt), in the prefill and later steps."""
    attn = layer(use_indexer=use_indexer)
    lengths, T, steps = (9, 4, 6), 9, 3
    x = hidden(B=3, T=T + steps)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, T - n :] = True
    cache = MLACache()
    padded = [attn(x[:, :T], cache=cache, token_mask=mask)]
    padded += [attn(x[:, t : t + 1], cache=cache) for t in range(T, T + steps)]
    padded = torch.cat(padded, 1)
    assert cache.key_mask.shape == (3, T + steps) and torch.equal(cache.key_mask[:, :T], mask)
    assert cache.key_mask[:, T:].all()
    for row, n in enumerate(lengths):
        alone_cache = MLACache()
        alone = [attn(x[row : row + 1, T - n : T], cache=alone_cache)]
        alone += [attn(x[row : row + 1, t : t + 1], cache=alone_cache) for t in range(T, T + steps)]
        alone = torch.cat(alone, 1)
        assert alone_cache.key_mask is None  # nothing padded: no mask kept
        assert rel(padded[row : row + 1, T - n :], alone) <= 1e-12, row
        assert rel(cache.c_kv[row : row + 1, T - n :], alone_cache.c_kv) <= 1e-12


def test_left_padded_indexer_loss_ignores_padded_keys():
    attn = layer()
    x = hidden(B=2, T=8)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :5] = False
    _, loss = attn(x, cache=MLACache(), token_mask=mask, return_indexer_loss=True)
    assert torch.isfinite(loss)


def test_bad_token_mask_is_refused_by_name():
    attn, x = layer(), hidden(B=2, T=5)
    with pytest.raises(ValueError, match="^token_mask:"):
        attn(x, token_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^token_mask:"):
        attn(x[:1], token_mask=torch.ones(1, 5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 2, 5]))
