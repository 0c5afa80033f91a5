"""The planner's meta run without patching (moe_plugin/plan/routing.py, ops.backend.planning_for): the balanced
dispatch in the MoE layers' own slot, on meta and for real; the GPU KDA kernel's saved set and working tensors
by hand; and a whole plan run during which no function or method of the package is replaced."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe_plugin.config import MoEConfig
from moe_plugin.layers import kda as kda_layer
from moe_plugin.layers.moe import StableLatentMoE, TokenDispatch
from moe_plugin.models import preset_config
from moe_plugin.ops.backend import planning_for
from moe_plugin.plan.routing import BalancedDispatch, kernels_device, plan_routing
from moe_plugin.plan.saved_bytes import _run

B, T, H, K, V = 1, 200, 2, 16, 32
BOUNDS = torch.tensor([0, 70, 200])  # two packed documents: 2 + 3 chunks of 64 tokens


def _kda_inputs():
    q, k, g = (torch.empty(B, T, H, K, dtype=torch.bfloat16, device="meta").requires_grad_() for _ in range(3))
    v = torch.empty(B, T, H, V, dtype=torch.bfloat16, device="meta").requires_grad_()
    beta = torch.empty(B, T, H, dtype=torch.bfloat16, device="meta").requires_grad_()
    return q, k, v, g, beta


def test_gpu_kda_kernel_holds_what_fla_saves():
    q, k, v, g, beta = _kda_inputs()
    working: list = []
    with planning_for("cuda"):
        saved = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda", working)
    two = 2  # bf16
    inputs = (3 * B * T * H * K + B * T * H * V + B * T * H) * two
    # fla 0.6's ChunkKDAFunction with recompute: its inputs, the fp32 chunk-local gate cumsum, Aqk and Akk
    assert saved["kda"] == inputs + B * T * H * K * 4 + 2 * B * T * H * 64 * two
    # made and dropped in the forward: the states of the 5 chunks, the WY factors w, u, the gated keys, the
    # new values, fp32 diagonal blocks
    states = 5 * H * K * V * two
    assert working[0] == states + (2 * B * T * H * K + 2 * B * T * H * V) * two + B * T * H * 16 * 4


def test_meta_tensors_take_the_torch_path_unless_planning_for_cuda():
    q, k, v, g, beta = _kda_inputs()
    saved = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda")
    with planning_for("cuda"):
        gpu = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda")
    with planning_for("cpu"):
        cpu = _run(lambda: kda_layer.chunk_kda(q, k, v, g, beta, cu_seqlens=BOUNDS)[0], {}, "kda")
    assert saved == cpu
    assert saved["kda"] > gpu["kda"]  # the torch path keeps its fp32 chunk tensors
    with pytest.raises(ValueError, match="device: must be 'cpu' or 'cuda'"):
        with planning_for("tpu"):
            pass
    with pytest.raises(ValueError, match="kernels"):
        kernels_device("tpu")
    assert kernels_device("gpu") == "cuda" and kernels_device("cpu") == "cpu"


def _moe(experts: int = 8, top_k: int = 2, expert_format: str = "dense") -> StableLatentMoE:
    config = MoEConfig(
        hidden_size=32,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=16,
        latent_size=16,
        num_shared_experts=1,
        shared_intermediate_size=16,
        expert_format=expert_format,
    )
    return StableLatentMoE(config)


def test_balanced_dispatch_sends_every_copy_and_combines_them_back():
    """On real tensors: the first N*k rows are each token's k copies, counts are equal blocks over the local
    experts, and the combine is the router-weighted sum of a token's copies (a plain loop here)."""
    torch.manual_seed(0)
    n, k, width = 5, 3, 4
    z = torch.randn(n, width, requires_grad=True)
    indices = torch.zeros(n, k, dtype=torch.long)  # values unused: the assignment is the planner's
    dispatch = BalancedDispatch(local_experts=4, capacity=1.5)
    rows, counts, order = dispatch.send(z, indices, 8)
    m = dispatch.rows(n, k)
    assert m == 4 * -(-n * k * 3 // (2 * 4)) and rows.shape == (m, width)
    assert counts.tolist() == [m // 4] * 4
    for p in range(n * k):
        assert torch.equal(rows[p], z[p // k].detach())
    y = rows * 2.0
    weights = torch.rand(n, k)
    out = dispatch.combine(y, order, weights)
    expected = torch.stack([sum(weights[t, j] * 2.0 * z[t] for j in range(k)) for t in range(n)])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    torch.testing.assert_close(z.grad, (2.0 * weights.sum(1, keepdim=True)).expand(n, width))


@pytest.mark.parametrize("expert_format", ["dense", "mxfp4"])
def test_plan_routing_gives_a_layer_this_ranks_experts(expert_format):
    """The layer keeps its router over all E experts, holds E / EP experts, and runs on meta as it is; what
    its experts save grows with the capacity factor."""
    saved = {}
    for capacity in (1.0, 2.0):
        with torch.device("meta"):
            moe = _moe(expert_format=expert_format)
        assert type(moe.dispatch) is TokenDispatch
        assert plan_routing(moe, BalancedDispatch(2, capacity)) == 1
        assert moe.experts.w1.shape[0] == 2 and moe.gate.weight.shape[0] == 8
        assert moe.experts.w1.is_meta and isinstance(moe.dispatch, BalancedDispatch)
        x = torch.empty(1, 64, 32, device="meta", requires_grad=True)
        out = _run(lambda moe=moe, x=x: moe(x)[0], {moe.experts: "experts"}, "moe")
        saved[capacity] = out["experts"]
    assert saved[2.0] > 1.8 * saved[1.0], saved
    with torch.device("meta"):
        moe = _moe()
    with pytest.raises(ValueError, match="local_experts"):
        plan_routing(moe, BalancedDispatch(9, 1.0))
    with pytest.raises(ValueError, match="capacity"):
        BalancedDispatch(2, 0.5)


def _package_functions():
    """Every function and class attribute of the loaded moe_plugin modules, and of torch.nn.functional."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not (name.startswith("moe_plugin") or name == "torch.nn.functional") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if callable(value):
                found[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    found[(name, attr, key)] = member
    return found


def test_a_plan_replaces_no_function_while_it_runs():
    """The whole activation plan of the tiny preset (KDA, gated MLA with the indexer, MoE, packed experts, GPU
    kernels) checked from inside its own meta run: at every module call, nothing of the package differs
    from before the run."""
    from moe_plugin.plan.activations import plan_activations
    from moe_plugin.recipe.schema import LoraSection

    mc = preset_config("tiny").to_model_config()
    plan_activations(mc, LoraSection(), 1, 128, 2, 1.0, kernels="gpu")  # imports whatever a run imports
    before = _package_functions()
    calls = []

    def check(module, args):
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            now = _package_functions()
            changed = [k for k, v in before.items() if now.get(k) is not v]
            calls.append(changed)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        plan = plan_activations(mc, LoraSection(), 1, 128, 2, 1.5, kernels="gpu", cache={})
    finally:
        handle.remove()
    assert plan.total > 0 and len(calls) > 10
    assert all(c == [] for c in calls), next(c for c in calls if c)
    assert isinstance(kda_layer.chunk_kda, types.FunctionType)
