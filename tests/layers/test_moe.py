"""StableLatentMoE and GLUMLP against per-token loops over the same parameters; K3 sizes; config errors."""

import math

import pytest
import torch

from moe_plugin.config import MoEConfig
from moe_plugin.layers.mlp import GLUMLP
from moe_plugin.layers.moe import StableLatentMoE
from moe_plugin.precision import apply_precision


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def situ(a, b, beta=4.0, lin=25.0):
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (lin * torch.tanh(b / lin))


def swiglu(a, b, *_):
    return a * torch.sigmoid(a) * b


def rms(u, w, eps):
    return u / torch.sqrt((u * u).mean() + eps) * w


def layer_loop(m: StableLatentMoE, x):
    """Per token: fp32 sigmoid router, top-k of score + bias, renormalised weights, each expert's GLU in the
    latent, sum, RMSNorm, up projection, plus the shared GLU on the hidden."""
    c = m.config
    act = situ if c.activation == "situ" else swiglu
    betas = (c.situ_beta, c.situ_linear_beta)
    bias = m.gate.e_score_correction_bias
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t]
        s = torch.sigmoid(m.gate.weight @ xt)
        chosen = torch.argsort(s + bias, descending=True)[: c.top_k].tolist()
        w = s[chosen] / s[chosen].sum() * c.routed_scaling_factor
        z = m.routed_expert_down_proj.weight @ xt if c.latent_size else xt
        u = sum(
            w[j] * (m.experts.w2[e] @ act(m.experts.w1[e] @ z, m.experts.w3[e] @ z, *betas))
            for j, e in enumerate(chosen)
        )
        if c.latent_size:
            if c.latent_norm:
                u = rms(u, m.routed_expert_norm.weight, c.norm_eps)
            u = m.routed_expert_up_proj.weight @ u
        if c.num_shared_experts:
            sh = m.shared_experts
            u = u + sh.down_proj.weight @ act(sh.gate_proj.weight @ xt, sh.up_proj.weight @ xt, *betas)
        out[t] = u
    return out


def build(seed=0, **kw):
    cfg = dict(
        hidden_size=16,
        num_experts=8,
        top_k=3,
        expert_intermediate_size=12,
        latent_size=8,
        num_shared_experts=1,
        shared_intermediate_size=20,
    )
    cfg.update(kw)
    torch.manual_seed(seed)
    m = StableLatentMoE(MoEConfig(**cfg))
    with torch.no_grad():  # non-trivial norm weight and selection bias, so the test sees both
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        m.gate.e_score_correction_bias.normal_(0, 0.05)
    return m


@pytest.mark.parametrize(
    "kw",
    [
        {},  # latent + norm + shared, SiTU
        {"latent_norm": False, "activation": "swiglu", "routed_scaling_factor": 2.0},
        {"latent_size": None, "num_shared_experts": 0, "num_groups": 1},
    ],
)
def test_layer_equals_token_loop(kw):
    m = build(**kw)
    x = torch.randn(2, 9, 16)
    y, load = m(x)
    assert y.shape == x.shape and load.dtype == torch.float32 and not load.requires_grad
    assert rel(y, layer_loop(m, x.reshape(-1, 16)).view_as(x)) < 1e-5
    assert int(load.sum()) == 18 * m.top_k


def test_layer_gradients_equal_token_loop():
    m = build(seed=1)
    x = torch.randn(1, 7, 16, requires_grad=True)
    g = torch.randn(1, 7, 16)
    params = [x] + list(m.parameters())
    grads = torch.autograd.grad(m(x)[0], params, g)
    grads_ref = torch.autograd.grad(layer_loop(m, x.view(-1, 16)).view_as(x), params, g)
    for a, b in zip(grads, grads_ref):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("top_k,forced", [(3, {2: -10.0}), (1, {5: 10.0})])
def test_empty_expert_and_all_tokens_on_one(top_k, forced):
    m = build(seed=2, top_k=top_k)
    with torch.no_grad():
        for e, v in forced.items():
            m.gate.e_score_correction_bias[e] = v
    x = torch.randn(1, 12, 16)
    y, load = m(x)
    assert rel(y, layer_loop(m, x[0]).view_as(x)) < 1e-5
    for e, v in forced.items():
        assert load[e] == (12 if v > 0 else 0)


def test_update_routing_bias_moves_toward_balance():
    m = build(seed=3, num_experts=8, top_k=2)
    with torch.no_grad():
        m.gate.weight.add_(torch.linspace(0.3, -0.3, 8)[:, None])  # skew by expert id
        m.gate.e_score_correction_bias.zero_()
    x = torch.randn(400, 16) + 0.3

    def imbalance():
        _, idx, scores = m.route(x)
        load = torch.bincount(idx.reshape(-1), minlength=8).float()
        return (load.max() / load.mean()).item() - 1, load, scores

    before, load, scores = imbalance()
    new = m.update_routing_bias(scores, method="quantile")
    assert torch.equal(new, m.gate.e_score_correction_bias) and imbalance()[0] < 0.5 * before
    m.gate.e_score_correction_bias.zero_()
    old = m.gate.e_score_correction_bias.clone()
    m.update_routing_bias(load, method="sign")
    assert torch.allclose(
        m.gate.e_score_correction_bias, old + m.config.bias_update_rate * torch.sign(load.mean() - load)
    )
    with pytest.raises(ValueError, match="^method:"):
        m.update_routing_bias(load, method="median")


def test_names_state_dict_and_fp32_router():
    m = build()
    keys = set(m.state_dict())
    assert {
        "gate.weight",
        "gate.e_score_correction_bias",
        "experts.w1",
        "experts.w3",
        "experts.w2",
        "routed_expert_down_proj.weight",
        "routed_expert_norm.weight",
        "routed_expert_up_proj.weight",
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    } == keys
    apply_precision(m, torch.bfloat16)  # the layer has no .to() override: the one policy sets dtypes
    assert m.gate.weight.dtype == torch.float32 and m.gate.e_score_correction_bias.dtype == torch.float32
    assert m.experts.w1.dtype == torch.bfloat16
    y, _ = m(torch.randn(1, 5, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    no_latent = build(latent_size=None, num_shared_experts=0)
    assert not any(k.startswith(("routed_expert", "shared")) for k in no_latent.state_dict())


def test_lora_on_router_gate_changes_routing_in_fp32_and_leaves_the_bias_frozen():
    from peft import LoraConfig, get_peft_model

    m = apply_precision(build(seed=4), torch.bfloat16)  # the router stays fp32, the input arrives in bf16
    x = torch.randn(24, 16).to(torch.bfloat16)
    with torch.no_grad():
        _, base_chosen, _ = m.route(x)
    peft_model = get_peft_model(torch.nn.Sequential(m), LoraConfig(r=2, lora_alpha=4, target_modules=["gate"]))
    inner = peft_model.base_model.model[0]
    lora_a, lora_b = inner.gate.lora_A["default"].weight, inner.gate.lora_B["default"].weight
    with torch.no_grad():
        lora_b.normal_(0.0, 1.0)  # peft starts B at zero; a trained adapter does not
    bias = inner.router.e_score_correction_bias
    bias_before = bias.clone()

    logits = inner.gate(x)
    assert logits.dtype == torch.float32
    xd = x.double()  # W x + (alpha / r) B A x, by hand
    expected = xd @ inner.router.weight.double().T + 2.0 * (xd @ lora_a.double().T) @ lora_b.double().T
    assert rel(logits, expected) < 1e-6
    with torch.no_grad():
        _, chosen, _ = inner.route(x)
    assert not torch.equal(chosen.sort(-1).values, base_chosen.sort(-1).values)

    assert not any("e_score_correction_bias" in name for name, _ in peft_model.named_parameters())
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(lora_a), id(lora_b)}
    opt = torch.optim.SGD(trainable, lr=1.0)
    y, _ = inner(x.view(1, 24, 16))
    y.float().square().sum().backward()
    opt.step()
    assert lora_a.grad is not None and lora_a.grad.abs().sum() > 0
    assert torch.equal(bias, bias_before) and bias is inner.router.e_score_correction_bias


def test_to_bf16_keeps_router_weight_and_bias_bit_identical():
    m = build(seed=5)
    weight, bias = m.gate.weight.detach().clone(), m.gate.e_score_correction_bias.clone()
    # values that bf16 cannot hold, so a round trip through it would show
    assert not torch.equal(weight.bfloat16().float(), weight)
    assert not torch.equal(bias.bfloat16().float(), bias)
    apply_precision(m, torch.bfloat16)
    assert m.gate.weight.dtype == torch.float32 and torch.equal(m.gate.weight, weight)
    assert m.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(m.gate.e_score_correction_bias, bias)
    assert isinstance(m.gate.weight, torch.nn.Parameter) and m.experts.w1.dtype == torch.bfloat16
    apply_precision(m, torch.float16)
    assert m.experts.w1.dtype == torch.float16 and torch.equal(m.gate.weight, weight)
    assert torch.equal(m.gate.e_score_correction_bias, bias)


def test_router_materialised_from_meta_is_fp32():
    with torch.device("meta"):
        m = StableLatentMoE(MoEConfig(hidden_size=16, num_experts=8, top_k=3, expert_intermediate_size=12))
    apply_precision(m, torch.bfloat16).to_empty(device="cpu")
    assert m.gate.weight.device.type == "cpu" and m.gate.weight.dtype == torch.float32
    assert m.gate.e_score_correction_bias.dtype == torch.float32 and m.experts.w1.dtype == torch.bfloat16


def test_glu_mlp_matches_formula():
    torch.manual_seed(5)
    for act, fn in (("situ", situ), ("swiglu", swiglu)):
        mlp = GLUMLP(10, 14, activation=act)
        x = torch.randn(3, 10)
        want = torch.stack([mlp.down_proj.weight @ fn(mlp.gate_proj.weight @ r, mlp.up_proj.weight @ r) for r in x])
        assert rel(mlp(x), want) < 1e-6
    mlp = GLUMLP(10, 14, situ_beta=2.0, situ_linear_beta=3.0)
    x = torch.randn(3, 10) * 5
    want = mlp.down_proj(situ(mlp.gate_proj(x), mlp.up_proj(x), 2.0, 3.0))
    assert rel(mlp(x), want) < 1e-6
    with pytest.raises(ValueError, match="^activation:"):
        GLUMLP(4, 4, activation="gelu")


def test_k3_parameter_counts_on_meta():
    cfg = MoEConfig(
        hidden_size=7168,
        num_experts=896,
        top_k=16,
        expert_intermediate_size=3072,
        latent_size=3584,
        num_shared_experts=2,
        shared_intermediate_size=6144,
    )
    with torch.device("meta"):
        m = StableLatentMoE(cfg)
    per_expert = sum(p[0].numel() for p in (m.experts.w1, m.experts.w3, m.experts.w2))
    assert per_expert == 3 * 3584 * 3072 == 33_030_144
    everything = sum(p.numel() for p in m.parameters()) + sum(b.numel() for b in m.buffers())
    assert everything - 896 * per_expert == 189_927_808


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"top_k": 9}, "MoEConfig.top_k"),
        ({"num_groups": 3}, "MoEConfig.num_groups"),
        ({"num_groups": 2, "topk_groups": 3}, "MoEConfig.topk_groups"),
        ({"num_groups": 4, "topk_groups": 1, "top_k": 3}, "MoEConfig.top_k"),
        ({"activation": "gelu"}, "MoEConfig.activation"),
        ({"latent_size": 0}, "MoEConfig.latent_size"),
        ({"num_shared_experts": -1}, "MoEConfig.num_shared_experts"),
        ({"expert_intermediate_size": 0}, "MoEConfig.expert_intermediate_size"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    cfg = dict(hidden_size=16, num_experts=8, top_k=2, expert_intermediate_size=12)
    cfg.update(kw)
    with pytest.raises(ValueError, match=f"^{field}:"):
        MoEConfig(**cfg)


def test_shared_width_defaults_to_experts_times_width():
    assert (
        MoEConfig(
            hidden_size=8, num_experts=4, top_k=1, expert_intermediate_size=6, num_shared_experts=2
        ).shared_intermediate_size
        == 12
    )
    assert math.isclose(build().config.situ_beta, 4.0)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_equals_transformers_deepseek_v3_moe(groups):
    """Without latent and with SwiGLU the layer is DeepSeek-V3's MoE: same weights, same output."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    e, f, d = 16, 12, 20
    hf_cfg = DeepseekV3Config(
        hidden_size=d,
        n_routed_experts=e,
        num_experts_per_tok=4,
        moe_intermediate_size=f,
        n_shared_experts=1,
        n_group=groups[0],
        topk_group=groups[1],
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        hidden_act="silu",
    )
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(6)
    hf = DeepseekV3MoE(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    ours = StableLatentMoE(
        MoEConfig(
            hidden_size=d,
            num_experts=e,
            top_k=4,
            expert_intermediate_size=f,
            latent_size=None,
            num_shared_experts=1,
            activation="swiglu",
            routed_scaling_factor=1.5,
            num_groups=groups[0],
            topk_groups=groups[1],
        )
    )
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.w1.copy_(hf.experts.gate_up_proj[:, :f])
        ours.experts.w3.copy_(hf.experts.gate_up_proj[:, f:])
        ours.experts.w2.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_experts, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    x = torch.randn(2, 10, d)
    assert rel(ours(x)[0], hf(x)) < 1e-5


def test_router_reset_zeroes_selection_bias():
    m = build()
    with torch.no_grad():
        m.gate.e_score_correction_bias.fill_(3.0)
    m.gate.reset_parameters()  # what initialising after to_empty() calls
    assert torch.equal(m.gate.e_score_correction_bias, torch.zeros(8))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "swiglu", "routed_scaling_factor": 1.5, "renormalize": False, "num_groups": 2, "topk_groups": 1},
    ],
)
def test_layer_without_latent_or_shared_equals_moe_forward_op(kw):
    from moe_plugin.ops.moe import moe_forward

    m = build(seed=3, latent_size=None, num_shared_experts=0, **kw)
    c = m.config
    x = torch.randn(2, 9, c.hidden_size)
    y, load = m(x)
    y_op, tokens_per_expert = moe_forward(
        x.reshape(-1, c.hidden_size),
        m.gate.weight,
        m.experts.w1,
        m.experts.w3,
        m.experts.w2,
        c.top_k,
        bias=m.gate.e_score_correction_bias,
        activation=c.activation,
        renormalize=c.renormalize,
        scaling=c.routed_scaling_factor,
        num_groups=c.num_groups,
        topk_groups=c.topk_groups,
        beta=c.situ_beta,
        linear_beta=c.situ_linear_beta,
    )
    assert rel(y.reshape(-1, c.hidden_size), y_op) < 1e-6
    assert torch.equal(load, tokens_per_expert.float())
