"""KDAAttention: cached decoding, packed sequences, K3's names and size, and transformers' Kimi-Linear layer."""

import importlib
import pytest
import torch

from moe_plugin.config import KDAConfig
from moe_plugin.layers.kda import KDAAttention, KDACache


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def tiny(gate_form="k3", **kw):
    torch.manual_seed(0)
    cfg = dict(hidden_size=32, num_heads=2, head_dim=8, conv_size=4, chunk_size=16, gate_form=gate_form)
    cfg.update(kw)
    layer = KDAAttention(KDAConfig(**cfg))
    with torch.no_grad():  # larger weights than the 0.02 init so that every path moves the output
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("gate_form", ["k3", "kimi_linear"])
def test_cached_decoding_equals_full_forward(gate_form):
    layer = tiny(gate_form)
    x = torch.randn(2, 23, 32)
    with torch.no_grad():
        full = layer(x)
        for prefill in (0, 1, 7):
            cache = KDACache()
            outs = [layer(x[:, :prefill], cache=cache)] if prefill else []
            outs += [layer(x[:, t : t + 1], cache=cache) for t in range(prefill, 23)]
            assert rel(torch.cat(outs, 1), full) <= 1e-5, prefill
            assert cache.state.shape == (2, 2, 8, 8) and cache.state.dtype == torch.float32
            assert cache.q_conv.shape == cache.k_conv.shape == cache.v_conv.shape == (2, 16, 3)


def test_multi_token_continuation_with_cache():
    layer = tiny()
    x = torch.randn(1, 40, 32)
    with torch.no_grad():
        full = layer(x)
        cache = KDACache()
        parts = [layer(x[:, a:b], cache=cache) for a, b in ((0, 13), (13, 14), (14, 40))]
    assert rel(torch.cat(parts, 1), full) <= 1e-5


def test_packed_sequences_equal_each_alone():
    layer = tiny()
    lengths = [5, 17, 1, 9]
    cu = torch.tensor([0, 5, 22, 23, 32])
    x = torch.randn(1, sum(lengths), 32)
    with torch.no_grad():
        packed = layer(x, cu_seqlens=cu)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert rel(packed[:, a:b], layer(x[:, a:b])) <= 1e-5


def test_backward_reaches_every_parameter():
    layer = tiny()
    layer(torch.randn(2, 20, 32)).square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_cu_seqlens_with_cache_is_refused():
    layer = tiny()
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        layer(torch.randn(1, 4, 32), cu_seqlens=torch.tensor([0, 2, 4]), cache=KDACache())
    with pytest.raises(ValueError, match="^hidden_states:"):
        layer(torch.randn(1, 4, 31))


def test_k3_names_shapes_and_parameter_count():
    cfg = KDAConfig(hidden_size=7168, num_heads=96, head_dim=128, gate_rank=128, conv_size=4)
    with torch.device("meta"):
        layer = KDAAttention(cfg)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "q_proj.weight": (12288, 7168),
        "k_proj.weight": (12288, 7168),
        "v_proj.weight": (12288, 7168),
        "q_conv1d.weight": (12288, 1, 4),
        "k_conv1d.weight": (12288, 1, 4),
        "v_conv1d.weight": (12288, 1, 4),
        "f_a_proj.weight": (128, 7168),
        "f_b_proj.weight": (12288, 128),
        "b_proj.weight": (96, 7168),
        "g_proj.weight": (12288, 7168),
        "A_log": (96,),
        "dt_bias": (12288,),
        "o_norm.weight": (128,),
        "o_proj.weight": (7168, 12288),
    }
    assert sum(p.numel() for p in layer.parameters()) == 443_740_384
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32


def test_init_is_sensible():
    layer = KDAAttention(KDAConfig(hidden_size=64, num_heads=4, head_dim=16))
    assert 0.015 < layer.q_proj.weight.std().item() < 0.025
    rates = layer.A_log.exp()
    assert bool(((rates >= 1) & (rates <= 16)).all())
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert bool(((dt > 0.9e-3) & (dt < 1.1e-1)).all())
    assert torch.equal(layer.o_norm.weight, torch.ones(16))


def test_equals_transformers_kimi_linear_layer():
    """With the Kimi-Linear gate and a full-rank copy of its low-rank output gate, our layer is theirs."""
    modeling = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    hf_cfg = KimiLinearConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4},
        layer_types=["linear_attention"],
    )
    torch.manual_seed(3)
    theirs = modeling.KimiLinearDeltaAttention(hf_cfg, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        theirs.forget_gate.A_log.uniform_(0, 2)
    ours = KDAAttention(
        KDAConfig(hidden_size=32, num_heads=2, head_dim=8, gate_form="kimi_linear", chunk_size=16, norm_eps=1e-5)
    )
    conv_q, conv_k, conv_v = theirs.conv1d.weight.chunk(3, dim=0)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
        ours.q_conv1d.weight.copy_(conv_q)
        ours.k_conv1d.weight.copy_(conv_k)
        ours.v_conv1d.weight.copy_(conv_v)
        ours.f_a_proj.weight.copy_(theirs.forget_gate.f_a_proj.weight)
        ours.f_b_proj.weight.copy_(theirs.forget_gate.f_b_proj.weight)
        ours.A_log.copy_(theirs.forget_gate.A_log.view(-1))
        ours.dt_bias.copy_(theirs.forget_gate.dt_bias)
        ours.g_proj.weight.copy_(theirs.g_b_proj.weight @ theirs.g_a_proj.weight)
        x = torch.randn(2, 70, 32)
        assert rel(ours(x), theirs(x)) <= 1e-5


@pytest.mark.parametrize("gate_form", ["k3", "kimi_linear"])
def test_left_padded_prefill_equals_each_row_alone(gate_form):
    """Padded tokens leave the state and conv tails as for the unpadded prompt, in the prefill and after."""
    layer = tiny(gate_form)
    lengths, T, steps = (20, 2, 13), 20, 3  # 2 < conv_size - 1: the conv tail keeps zeros of the empty state
    x = torch.randn(3, T + steps, 32)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, T - n :] = True
    with torch.no_grad():
        cache = KDACache()
        padded = [layer(x[:, :T], cache=cache, token_mask=mask)]
        padded += [layer(x[:, t : t + 1], cache=cache) for t in range(T, T + steps)]
        padded = torch.cat(padded, 1)
        for row, n in enumerate(lengths):
            alone_cache = KDACache()
            alone = [layer(x[row : row + 1, T - n : T], cache=alone_cache)]
            alone += [layer(x[row : row + 1, t : t + 1], cache=alone_cache) for t in range(T, T + steps)]
            alone = torch.cat(alone, 1)
            assert rel(padded[row : row + 1, T - n :], alone) <= 1e-5, row
            for name in ("state", "q_conv", "k_conv", "v_conv"):
                assert rel(getattr(cache, name)[row : row + 1], getattr(alone_cache, name)) <= 1e-5, (row, name)


def test_bad_token_mask_is_refused_by_name():
    layer = tiny()
    with pytest.raises(ValueError, match="^token_mask:"):
        layer(torch.randn(2, 5, 32), token_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^token_mask:"):
        layer(torch.randn(1, 4, 32), token_mask=torch.ones(1, 4, dtype=torch.bool), cu_seqlens=torch.tensor([0, 2, 4]))
