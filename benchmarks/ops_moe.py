"""MoE forward+backward on the CPU: ours vs transformers' DeepseekV3MoE, and a dense matmul of equal FLOPs.

Every variant is a ``setup(**kwargs) -> step`` for ``harness.run_variant``; all share one shape (default:
2048 tokens, hidden 256, 64 experts, top-8, expert width 128, one shared expert, SwiGLU, fp32, no latent)
and the same N(0, 0.02) weights, so the routing and the work are identical. Run ``python -m
benchmarks.ops_moe`` (the full size takes a few seconds per variant; tests use tiny shapes).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

SHAPE = dict(tokens=2048, hidden=256, experts=64, top_k=8, width=128, shared=1)


def _hf_moe(implementation: str, hidden: int, experts: int, top_k: int, width: int, shared: int, seed: int = 0):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        n_shared_experts=shared,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        hidden_act="silu",
    )
    # transformers 5.24 picks the experts' forward from config._experts_implementation at call time
    # (integrations/moe.py, use_experts_implementation): "eager" is the per-expert loop in the class.
    cfg._experts_implementation = implementation
    torch.manual_seed(seed)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


def _ours_layer(hidden: int, experts: int, top_k: int, width: int, shared: int, seed: int = 0):
    """Our StableLatentMoE at DeepseekV3MoE's math, holding the very same weights."""
    from moe_plugin.config import MoEConfig
    from moe_plugin.layers.moe import StableLatentMoE

    hf = _hf_moe("eager", hidden, experts, top_k, width, shared, seed)
    cfg = MoEConfig(
        hidden_size=hidden,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=width,
        latent_size=None,
        num_shared_experts=shared,
        activation="swiglu",
    )
    ours = StableLatentMoE(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate_up = hf.experts.gate_up_proj
        ours.experts.w1.copy_(gate_up[:, :width])
        ours.experts.w3.copy_(gate_up[:, width:])
        ours.experts.w2.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_experts, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return ours


def _step(module: torch.nn.Module, tokens: int, hidden: int, output: Callable) -> Callable[[], None]:
    torch.manual_seed(1)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    grad = torch.randn(1, tokens, hidden)
    params = list(module.parameters())

    def step():
        for p in params + [x]:
            p.grad = None
        output(module(x)).backward(grad)

    return step


def hf_moe_step(
    implementation: str = "grouped_mm",
    tokens: int = 2048,
    hidden: int = 256,
    experts: int = 64,
    top_k: int = 8,
    width: int = 128,
    shared: int = 1,
):
    """transformers' DeepseekV3MoE with its "eager" or "grouped_mm" experts."""
    moe = _hf_moe(implementation, hidden, experts, top_k, width, shared)
    return _step(moe, tokens, hidden, lambda y: y)


def ours_layer_step(
    tokens: int = 2048, hidden: int = 256, experts: int = 64, top_k: int = 8, width: int = 128, shared: int = 1
):
    """Our StableLatentMoE (no latent, SwiGLU), same weights as the DeepseekV3MoE variants."""
    moe = _ours_layer(hidden, experts, top_k, width, shared)
    return _step(moe, tokens, hidden, lambda out: out[0])


def dense_step(
    tokens: int = 2048, hidden: int = 256, experts: int = 64, top_k: int = 8, width: int = 128, shared: int = 1
):
    """One matmul ``[tokens, hidden] @ [hidden, n]`` forward+backward with the MoE step's matmul FLOPs.

    n = router (E) + routed GLUs (3 k F) + shared GLU (3 * shared * F): the MoE's products, each
    ``2 * tokens * hidden * n`` forward and twice that backward, summed into one dense product.
    """
    n = experts + 3 * top_k * width + 3 * shared * width
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(hidden, n) * 0.02).requires_grad_(True)
    grad = torch.randn(tokens, n)

    def step():
        x.grad = w.grad = None
        (x @ w).backward(grad)

    return step


def main(threads: int = 2, iters: int = 3, **shape) -> List[str]:
    from benchmarks.harness import machine_line, run_variant

    kw = dict(SHAPE, **shape)
    names = {
        "ours": ("benchmarks.ops_moe:ours_layer_step", {}),
        "eager": ("benchmarks.ops_moe:hf_moe_step", {"implementation": "eager"}),
        "grouped_mm": ("benchmarks.ops_moe:hf_moe_step", {"implementation": "grouped_mm"}),
        "dense": ("benchmarks.ops_moe:dense_step", {}),
    }
    times: Dict[str, float] = {}
    for key, (target, extra) in names.items():
        res = run_variant(target, threads=threads, iters=iters, **kw, **extra)
        if "error" in res:
            raise RuntimeError(f"{key}: {res['error']}")
        times[key] = res["seconds"]
    ms = {k: 1e3 * v for k, v in times.items()}
    lines = [
        machine_line(threads),
        f"moe ours vs DeepseekV3MoE grouped_mm: {times['grouped_mm'] / times['ours']:.2f}x "
        f"(ours {ms['ours']:.0f} ms, eager {ms['eager']:.0f} ms, grouped_mm {ms['grouped_mm']:.0f} ms); "
        f"efficiency vs dense matmul of equal FLOPs: {times['dense'] / times['ours']:.2f} "
        f"(dense {ms['dense']:.0f} ms; tokens {kw['tokens']}, hidden {kw['hidden']}, {kw['experts']} experts "
        f"top-{kw['top_k']}, width {kw['width']}, {kw['shared']} shared, fp32)",
    ]
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
