"""What storing the policy's fp32 tensors in bf16 (and computing with them in fp32) would cost, side by side with
keeping them fp32 in one run (docs/precision.md): the alternative the policy rejects for frozen tensors, and
what DeepSpeed's bf16 engine does to trainable ones.

    .venv/bin/python -m benchmarks.precision_error

* the shipped tiny base (recipes/bases/tiny-arith) on arithmetic text: the fraction of (token, MoE layer)
  routing choices that change when only the router weight and bias are rounded through bf16 (each layer
  routes the same inputs), and the logits' relative error when the router, or KDA's A_log/dt_bias, are;
* a K3-sized router (hidden 7168, 896 experts, top 16): the fraction of tokens whose chosen expert set
  changes, with random weights and a selection bias around the magnitude the balancing rule gives;
* the memory the policy's buffers take at K3 size against bf16 ZeRO-3 partitions.
"""

from __future__ import annotations

import copy
import platform

import torch

from moe_plugin.layers.kda import KDAAttention
from moe_plugin.layers.moe import MoERouter, StableLatentMoE, route_logits
from moe_plugin.models import MoEPluginForCausalLM
from moe_plugin.ops.moe import route

BASE = "recipes/bases/tiny-arith"


def _round(model, owner, names):
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, owner):
                for name in names:
                    t = getattr(module, name)
                    t.copy_(t.bfloat16().float())
    return rounded


def _arithmetic_ids(n_rows: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    text = [f"{int(a)}-{int(b)}={int(a - b)};" for a, b in torch.randint(10, 100, (n_rows * seq // 6, 2), generator=g)]
    data = "".join(text).encode()[: n_rows * seq]
    return torch.tensor(list(data), dtype=torch.long).view(n_rows, seq)  # byte-level ids


def tiny_base() -> list:
    model = MoEPluginForCausalLM.from_pretrained(BASE).eval()
    ids = _arithmetic_ids(8, 128)
    inputs = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: inputs.append((mod, args[0].reshape(-1, args[0].shape[-1]))))
        for m in model.modules()
        if isinstance(m, StableLatentMoE)
    ]
    with torch.no_grad():
        exact = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    flips = total = 0
    with torch.no_grad():
        for moe, x in inputs:
            _, chosen, _ = moe.route(x)
            r = moe.router
            cfg = moe.config
            logits = torch.nn.functional.linear(x.float(), r.weight.bfloat16().float())
            # the layer's own routing rule (groups included), on the bf16-rounded router
            _, chosen_bf16, _ = route_logits(cfg, logits, r.e_score_correction_bias.bfloat16().float())
            flips += int((chosen.sort(-1).values != chosen_bf16.sort(-1).values).any(-1).sum())
            total += chosen.shape[0]
        router = _round(model, MoERouter, ("weight", "e_score_correction_bias"))(input_ids=ids).logits
        decay = _round(model, KDAAttention, ("A_log", "dt_bias"))(input_ids=ids).logits
    rel = lambda a: float((a - exact).norm() / exact.norm())  # noqa: E731
    return [
        f"tiny base ({BASE}, {ids.numel()} tokens): routing choices changed by a bf16 router "
        f"{flips}/{total} ({flips / total:.2%}) vs 0 in fp32",
        f"tiny base: logits relative error, bf16-stored router {rel(router):.2e}, bf16-stored A_log/dt_bias "
        f"{rel(decay):.2e}, vs 0 for both in fp32",
    ]


def k3_router(tokens: int = 2048) -> list:
    g = torch.Generator().manual_seed(1)
    hidden, experts, k = 7168, 896, 16
    weight = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    bias = torch.randn(experts, generator=g) * 0.05
    x = torch.randn(tokens, hidden, generator=g)
    _, exact, _ = route(x @ weight.T, k, bias=bias)
    _, rounded, _ = route(x @ weight.bfloat16().float().T, k, bias=bias.bfloat16().float())
    changed = int((exact.sort(-1).values != rounded.sort(-1).values).any(-1).sum())
    return [
        f"K3-sized router (7168 -> 896, top 16, {tokens} random tokens): tokens whose expert set changes "
        f"with a bf16-stored router {changed}/{tokens} ({changed / tokens:.2%}) vs 0 in fp32"
    ]


def k3_memory() -> list:
    router = 896 * 7168 * 92
    decay = 69 * (96 + 96 * 128)
    fp32_gb = (router + decay) * 4 / 1e9
    bf16_partition_gb = (router + decay) * 2 / 128 / 1e9
    return [
        f"K3 memory per rank: fp32 buffers (router {router:,} + decay {decay:,} values) {fp32_gb:.2f} GB vs "
        f"bf16 ZeRO-3 partitions over 128 ranks {bf16_partition_gb:.3f} GB "
        f"(ratio {fp32_gb / bf16_partition_gb:.0f}x)"
    ]


def main() -> None:
    torch.set_num_threads(2)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 2 threads")
    for line in tiny_base() + k3_router() + k3_memory():
        print(line)


if __name__ == "__main__":
    main()
