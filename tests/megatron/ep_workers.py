"""Rank-side code of the expert-parallel tests: run by moe_plugin.testing.launch.run_distributed.

One launch runs every check (starting processes and importing megatron-core costs seconds); each check's
result, or its traceback, goes back to the parent, which asserts. Nothing here asserts.

The global weights are drawn from one seed on every rank; each rank draws its own tokens. An EP rank
loads only its own experts (slices of the global stacks), so EP=2 must reproduce what one device holding
all experts computes for the same tokens.
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

H, E, FFN = 16, 4, 12  # hidden, experts, expert width of megatron's own MoE layer
LATENT = dict(
    hidden_size=16,
    num_experts=4,
    top_k=2,
    expert_intermediate_size=12,
    latent_size=8,
    num_shared_experts=1,
    shared_intermediate_size=20,
    activation="situ",
)
TOKENS = (5, 3)  # [S, B] per rank


# Routing scenarios for megatron's MoELayer: (top_k, how the tokens are steered).
#   mixed:      free routing
#   starved:    expert 3 (EP rank 1) is never chosen, so a local expert receives no tokens
#   one_expert: top-1 and every token goes to expert 2: EP rank 0 receives no tokens at all
MOE_SCENARIOS = {"mixed": (2, None), "starved": (2, ("avoid", 3)), "one_expert": (1, ("force", 2))}
# Scenarios for LatentMoELayer: the selection bias steers the choice.
LATENT_SCENARIOS = {"mixed": None, "starved": ("avoid", 3)}


def run_all_checks(ep_size: int = 2, seed: int = 0) -> dict:
    """Every check at this rank; returns {check name: result dict or {"error": traceback}}."""
    from moe_plugin.parallel.distributed import initialize_megatron

    initialize_megatron(expert_model_parallel_size=ep_size, seed=seed + 1)  # the launcher prepared the CPU
    results = {}
    checks = [("rng", _rng_streams)]
    checks += [(f"moe/{name}", lambda name=name: _megatron_moe(name, seed)) for name in MOE_SCENARIOS]
    checks += [(f"latent/{name}", lambda name=name: _latent_moe(name, seed)) for name in LATENT_SCENARIOS]
    checks.append(("gpt/latent", lambda: _gpt_with_latent_moe(seed)))
    checks.append(("latent/init", lambda: _expert_init(seed)))
    checks.append(("latent/balance", lambda: _balance(seed)))
    checks.append(("bad_ep_size", _bad_ep_size))
    checks.append(("overlap", lambda: _overlap(seed)))
    for name, check in checks:
        try:
            results[name] = check()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"rank {dist.get_rank()} check {name}: {results[name]['error']}", file=sys.stderr, flush=True)
        dist.barrier()  # a failed check must not leave the other rank inside a collective of the next one
    return results


def _overlap(seed: int) -> dict:
    """The expert-parallel dispatch in 1, 2 and 4 chunks, bit for bit (moe_plugin.testing.expert_dispatch)."""
    from moe_plugin.testing.expert_dispatch import overlap_parity

    return overlap_parity(seed)


def _bad_ep_size() -> dict:
    """An EP size that does not divide the world must be refused before megatron's state is touched."""
    from moe_plugin.parallel.distributed import initialize_megatron

    try:
        initialize_megatron(expert_model_parallel_size=dist.get_world_size() + 1)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": None}


def _rng_streams() -> dict:
    """Draws from megatron's RNG tracker: the expert-parallel stream must differ between EP ranks."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        expert = torch.rand(4)
    with tracker.fork():
        model = torch.rand(4)
    with tracker.fork():
        model_next = torch.rand(4)
    return {"expert": expert, "model": model, "model_next": model_next}


def _steer(x: torch.Tensor, rule) -> torch.Tensor:
    """Make the router's logits (dominated by x[..., :E], see _router_weight) avoid or favour one expert."""
    if rule is None:
        return x
    kind, expert = rule
    x = x.clone()
    if kind == "avoid":
        x[..., expert] = -3.0
    else:
        x[..., :E] *= 0.25
        x[..., expert] = 3.0
    return x


def _router_weight(g: torch.Generator, hidden: int) -> torch.Tensor:
    w = 0.1 * torch.randn(E, hidden, generator=g)
    w[:, :E] += 4.0 * torch.eye(E)
    return w


def _single_rank_groups():
    """A ProcessGroupCollection in which every group is this rank alone: megatron's MoELayer at EP=1."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = None
    for r in range(dist.get_world_size()):  # new_group is collective: every rank creates every group
        group = dist.new_group([r])
        if r == dist.get_rank():
            own = group
    pgs = ProcessGroupCollection()
    for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"):
        setattr(pgs, name, own)
    return pgs


def _megatron_moe(scenario: str, seed: int) -> dict:
    """megatron's own MoELayer (local SequentialMLP experts, alltoall) at EP=world and at EP=1."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    top_k, rule = MOE_SCENARIOS[scenario]
    g = torch.Generator().manual_seed(seed)
    weights = {
        "router": _router_weight(g, H),
        "fc1": 0.3 * torch.randn(E, 2 * FFN, H, generator=g),
        "fc2": 0.3 * torch.randn(E, H, FFN, generator=g),
    }
    x, grad_out = _rank_tokens(seed, H, rule)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=2 * H,
        num_moe_experts=E,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="alltoall",
        moe_router_score_function="sigmoid",
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    out = {"weights": weights, "x": x, "grad_out": grad_out}
    for tag, pgs in (("ep", None), ("ep1", _single_rank_groups())):
        layer = build_module(spec, config=config, pg_collection=pgs)
        local = layer.local_expert_indices
        with torch.no_grad():
            layer.router.weight.copy_(weights["router"])
            for i, e in enumerate(local):
                layer.experts.local_experts[i].linear_fc1.weight.copy_(weights["fc1"][e])
                layer.experts.local_experts[i].linear_fc2.weight.copy_(weights["fc2"][e])
        received = _spy_tokens_per_expert(layer.experts)
        y, grads = _forward_backward(layer, x, grad_out)
        experts = layer.experts.local_experts
        out[tag] = {
            "y": y,
            "x_grad": grads,
            "local": local,
            "received": received,
            "router_grad": layer.router.weight.grad.clone(),
            "fc1_grad": torch.stack([_grad(m.linear_fc1.weight) for m in experts]),
            "fc2_grad": torch.stack([_grad(m.linear_fc2.weight) for m in experts]),
            "sent": layer.token_dispatcher.routing_map.sum(0),
        }
    return out


def _latent_moe(scenario: str, seed: int) -> dict:
    """LatentMoELayer at EP=world; the exchange is spied on to record the width of what it moves."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.config import MoEConfig
    from moe_plugin.layers.moe import StableLatentMoE
    from moe_plugin.megatron.latent_moe import LatentMoELayer, megatron_moe_fields
    from moe_plugin.training.metrics.host_reads import count_host_reads

    moe = MoEConfig(**LATENT)
    torch.manual_seed(seed)  # the single-device layer draws the global weights identically on every rank
    reference = StableLatentMoE(moe)
    with torch.no_grad():
        reference.gate.weight.copy_(_router_weight(torch.Generator().manual_seed(seed), moe.hidden_size))
        bias = 0.05 * torch.randn(moe.num_experts, generator=torch.Generator().manual_seed(seed + 7))
        rule = LATENT_SCENARIOS[scenario]
        if rule is not None:
            bias[rule[1]] = -10.0  # the selection bias alone keeps this expert out of every top-k
        reference.gate.e_score_correction_bias.copy_(bias)
    global_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    config = TransformerConfig(
        num_layers=1,
        hidden_size=moe.hidden_size,
        num_attention_heads=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
        **megatron_moe_fields(moe),
    )
    layer = LatentMoELayer(config, moe)
    local = layer.local_expert_indices
    state = dict(global_state)
    for kind in ("w1", "w2", "w3"):
        state[f"experts.{kind}"] = global_state[f"experts.{kind}"][local[0] : local[-1] + 1]
    layer.load_state_dict(state)

    from moe_plugin.testing.expert_dispatch import dispatched_shapes

    with dispatched_shapes() as widths:
        x, grad_out = _rank_tokens(seed, moe.hidden_size, None)
        received = _spy_tokens_per_expert(layer.experts)
        with count_host_reads(layer) as reads:
            y, x_grad = _forward_backward(layer, x, grad_out)
    grads = {name: _grad(p) for name, p in layer.named_parameters()}
    return {
        "moe": LATENT,
        "global_state": global_state,
        "x": x,
        "grad_out": grad_out,
        "y": y,
        "x_grad": x_grad,
        "grads": grads,
        "local": local,
        "dispatched_shapes": widths,
        "host_reads": reads.detail(),
        "received": received,
        "load": layer.last_load,
        "state_keys": sorted(layer.state_dict()),
    }


def _gpt_with_latent_moe(seed: int) -> dict:
    """megatron's GPTModel (local spec) with LatentMoELayer as the MLP of every layer: one training step."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.config import MoEConfig
    from moe_plugin.megatron.latent_moe import LatentMoELayer, latent_moe_spec, megatron_moe_fields

    moe = MoEConfig(**LATENT)
    spec = get_gpt_layer_local_spec(num_experts=moe.num_experts, normalization="RMSNorm")
    spec.submodules.mlp = latent_moe_spec(moe)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=moe.hidden_size,
        num_attention_heads=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        **megatron_moe_fields(moe),
    )
    model = GPTModel(config, spec, vocab_size=32, max_sequence_length=8, position_embedding_type="none")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (2, 8), generator=g)
    labels = torch.randint(0, 32, (2, 8), generator=g)
    from moe_plugin.testing.expert_dispatch import dispatched_shapes

    with dispatched_shapes() as shapes:
        loss = model(tokens, None, None, labels=labels).mean()  # positions unused: no position embedding
        loss.backward()
    widths = [shape[-1] for shape in shapes]
    layers = model.decoder.layers
    return {
        "moe": LATENT,
        "loss": loss.item(),
        "widths": widths,
        "mlp_types": [type(layer.mlp).__name__ for layer in layers],
        "is_moe_layer": [layer.is_moe_layer for layer in layers],
        "isinstance": all(isinstance(layer.mlp, LatentMoELayer) for layer in layers),
        "no_grad": [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0],
    }


def _latent_config(moe, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.megatron.latent_moe import megatron_moe_fields

    return TransformerConfig(
        num_layers=1,
        hidden_size=moe.hidden_size,
        num_attention_heads=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
        **megatron_moe_fields(moe),
        **overrides,
    )


def _expert_init(seed: int) -> dict:
    """LatentMoELayer's initial experts at EP=world, at EP=1 and in bf16, from the same default-RNG state."""
    from moe_plugin.config import MoEConfig
    from moe_plugin.megatron.latent_moe import LatentMoELayer

    moe = MoEConfig(**LATENT)
    out = {}
    for tag, pgs, overrides in (
        ("ep", None, {}),
        ("ep1", _single_rank_groups(), {}),
        ("bf16", None, dict(params_dtype=torch.bfloat16, bf16=True)),
    ):
        torch.manual_seed(seed + 11)  # what megatron's seeding leaves behind: equal on every rank
        layer = LatentMoELayer(_latent_config(moe, **overrides), moe, pg_collection=pgs)
        out[tag] = {
            "local": layer.local_expert_indices,
            "dtypes": {n: p.dtype for n, p in layer.named_parameters()},
            **{k: getattr(layer.experts, k).detach().clone() for k in ("w1", "w2", "w3")},
        }
    return out


def _balance(seed: int) -> dict:
    """Two micro-batches with padding, one no-grad forward, then the global load and one sign update."""
    from megatron.core import parallel_state
    from torch import nn

    from moe_plugin.config import MoEConfig
    from moe_plugin.megatron.latent_moe import LatentMoELayer
    from moe_plugin.training.metrics.routing import moe_layers

    moe = MoEConfig(**LATENT)
    layer = LatentMoELayer(_latent_config(moe), moe)
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        layer.gate.weight.copy_(_router_weight(g, moe.hidden_size))
        layer.gate.e_score_correction_bias.copy_(0.05 * torch.randn(moe.num_experts, generator=g))
    bias_before = layer.router.e_score_correction_bias.clone()
    batches, masks = [], []
    for micro in range(2):
        x, _ = _rank_tokens(seed + 10 * micro, moe.hidden_size, None)  # [S, B, H]
        mask = torch.zeros(x.shape[1], x.shape[0], dtype=torch.bool)  # [B, S], True = padding
        mask[micro % x.shape[1], 2 + micro :] = True
        layer(x, padding_mask=mask)[0].sum().backward()
        batches.append(x)
        masks.append(mask)
    with torch.no_grad():
        layer(batches[0])  # evaluation: not counted
    model = nn.ModuleList([layer])
    local = layer.pop_load()
    after_pop = layer.last_load
    total = local.clone()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    layer.update_routing_bias(total)  # what training.step_math.balance_loads does with the summed load
    return {
        "x": batches,
        "padding_mask": masks,
        "router": layer.router.weight.detach().clone(),
        "bias_before": bias_before,
        "local_load": local,
        "after_pop": after_pop,
        "global_load": total,
        "bias_after": layer.router.e_score_correction_bias.clone(),
        "found": [type(m).__name__ for m in moe_layers(model)],
        "top_k": moe.top_k,
        "rate": moe.bias_update_rate,
    }


def _rank_tokens(seed: int, hidden: int, rule):
    g = torch.Generator().manual_seed(1000 * (seed + 1) + dist.get_rank())
    x = _steer(torch.randn(*TOKENS, hidden, generator=g), rule)
    return x, torch.randn(*TOKENS, hidden, generator=g)


def _forward_backward(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    y, bias = layer(x)
    if bias is not None:
        raise RuntimeError("the MoE layer returned an output bias; these layers have none")
    (y * grad_out).sum().backward()
    return y.detach(), x.grad.detach()


def _spy_tokens_per_expert(experts) -> list:
    """Record the tokens_per_expert each forward of ``experts`` receives (what this EP rank computes)."""
    seen, forward = [], experts.forward

    def recording(tokens, tokens_per_expert, probs):
        seen.append(torch.as_tensor(tokens_per_expert).clone())
        return forward(tokens, tokens_per_expert, probs)

    experts.forward = recording
    return seen


def _grad(p: torch.Tensor) -> torch.Tensor:
    # An expert that received no tokens may have no gradient at all: that is a zero gradient.
    return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
