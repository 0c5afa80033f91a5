"""DSA attention forward+backward on the CPU: ours vs transformers' DeepseekV32Attention.

Both variants run the very same layer (``DeepseekV32Attention`` at hidden 256, 4 heads, q/kv low rank 64,
qk 32 + 16, v 32, 4 index heads of 32, top-k 512, fp32, N(0, 0.02) weights) on the same input, projections,
rotary embeddings and ``o_proj`` INCLUDED in both. Only the attention core differs: transformers scores the
indexer over a dense ``T x T`` mask, folds the top-k into that mask and runs eager attention; ours calls
``indexer_topk`` and ``sparse_attention`` on the same q/k/v and index tensors. ``check_same_output`` shows
that both compute the same function. Run ``python -m benchmarks.ops_dsa`` (the lead's size is T = 8192);
``--baseline REV`` also times the op of an earlier commit (its ``moe_plugin`` from ``git archive``) in the same
run, side by side, and the host reads of one step of ours are counted (moe_plugin/training/metrics/host_reads.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional

import torch

SHAPE = dict(hidden=256, heads=4, q_rank=64, kv_rank=64, nope=32, rope=16, v=32, index_heads=4, index_dim=32, topk=512)


def _hf_layer(implementation: str = "eager", seed: int = 0):
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding

    s = SHAPE
    cfg = DeepseekV32Config(
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        q_lora_rank=s["q_rank"],
        kv_lora_rank=s["kv_rank"],
        qk_nope_head_dim=s["nope"],
        qk_rope_head_dim=s["rope"],
        v_head_dim=s["v"],
        index_n_heads=s["index_heads"],
        index_head_dim=s["index_dim"],
        index_topk=s["topk"],
        num_hidden_layers=1,
    )
    cfg._attn_implementation = implementation
    torch.manual_seed(seed)
    layer = DeepseekV32Attention(cfg, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:  # the Linear weights; norms keep their ones
                p.normal_(0.0, 0.02)
    return layer, DeepseekV32RotaryEmbedding(cfg)


def _inputs(T: int, rotary, seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randn(1, T, SHAPE["hidden"])
    cos, sin = rotary(x, torch.arange(T)[None])
    return x, (cos, sin)


def _causal_mask(T: int) -> torch.Tensor:
    return torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]


def ours_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepseekV32Attention's math with our indexer_topk + sparse_attention as its attention core."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    from moe_plugin.ops.dsa import indexer_topk, sparse_attention

    B, T, _ = x.shape
    H, nope, rope = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim
    q_resid = layer.q_a_layernorm(layer.q_a_proj(x))
    q_pass, q_rot = layer.q_b_proj(q_resid).view(B, T, H, -1).split([nope, rope], dim=-1)
    kv_pass, k_rot = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.unsqueeze(2), cos, sin, unsqueeze_dim=2)
    k_nope, v = layer.kv_b_proj(layer.kv_a_layernorm(kv_pass)).view(B, T, H, -1).split([nope, layer.v_head_dim], dim=-1)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(B, T, H, rope)], dim=-1)

    ix = layer.indexer
    with torch.no_grad():  # as in transformers: the indexer is not trained through the attention
        qi = ix.wq_b(q_resid).view(B, T, ix.n_heads, ix.head_dim)
        ki = ix.k_norm(ix.wk(x)).unsqueeze(2)
        qi_rot, ki_rot = apply_rotary_pos_emb(qi[..., :rope], ki[..., :rope], cos, sin, unsqueeze_dim=2)
        qi = torch.cat([qi_rot, qi[..., rope:]], dim=-1)
        ki = torch.cat([ki_rot, ki[..., rope:]], dim=-1).squeeze(2)
        w = ix.weights_proj(x) * (ix.n_heads**-0.5 * ix.softmax_scale)
        indices = indexer_topk(qi, ki, w, ix.index_topk)
    o = sparse_attention(q, k, v, indices, layer.scaling)
    return layer.o_proj(o.reshape(B, T, -1))


def _step(forward: Callable[[], torch.Tensor], params) -> Callable[[], None]:
    def step():
        for p in params:
            p.grad = None
        forward().sum().backward()

    return step


def hf_step(T: int = 8192, implementation: str = "eager"):
    """transformers' DeepseekV32Attention (dense T x T mask, top-k folded into it)."""
    layer, rotary = _hf_layer(implementation)
    x, pos = _inputs(T, rotary)
    mask = _causal_mask(T)
    return _step(lambda: layer(x, pos, mask)[0], list(layer.parameters()))


def _use_moe_plugin_from(root: str) -> None:
    """Import ``moe_plugin`` from ``root`` (a baseline's tree) instead of this checkout's, in this process."""
    if any(name == "moe_plugin" or name.startswith("moe_plugin.") for name in sys.modules):
        raise RuntimeError("moe_plugin is already imported: a baseline needs a fresh process")
    sys.path.insert(0, root)


def ours_step(T: int = 8192, root: Optional[str] = None):
    """The same layer and weights with our indexer_topk + sparse_attention core (root: a baseline's tree)."""
    if root is not None:
        _use_moe_plugin_from(root)
    layer, rotary = _hf_layer()
    x, (cos, sin) = _inputs(T, rotary)
    return _step(lambda: ours_forward(layer, x, cos, sin), list(layer.parameters()))


def check_same_output(T: int = 256) -> float:
    """Relative difference ||ours - transformers|| / ||transformers|| of the layer outputs at length T."""
    layer, rotary = _hf_layer()
    x, (cos, sin) = _inputs(T, rotary)
    with torch.no_grad():
        ref = layer(x, (cos, sin), _causal_mask(T))[0]
        ours = ours_forward(layer, x, cos, sin)
    return float((ours - ref).norm() / ref.norm())


def host_reads_per_step(T: int) -> dict:
    """Host reads of one forward+backward of ours at length T, by call (``{"tolist": 1}``, say)."""
    from torch import nn

    from moe_plugin.training.metrics.host_reads import count_host_reads

    step = ours_step(T)
    with count_host_reads(nn.Identity()) as counts:
        step()
    return {call: n for (_, call), n in sorted(counts.detail().items())}


def _archive(rev: str, into: str) -> str:
    """``moe_plugin`` of commit ``rev`` under ``into``; returns ``into``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tar = subprocess.run(["git", "archive", rev, "moe_plugin"], cwd=root, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
    return into


def _vs_line(label: str, ours: dict, hf: dict, T: int, err: float, check_T: int) -> str:
    return (
        f"dsa sparse{label} vs transformers deepseek_v32: {hf['seconds'] / ours['seconds']:.1f}x faster, memory "
        f"{ours['peak_mib'] / max(hf['peak_mib'], 1e-9):.2f}x (ours {ours['seconds']:.2f} s +{ours['peak_mib']:.0f} "
        f"MiB, transformers eager {hf['seconds']:.2f} s +{hf['peak_mib']:.0f} MiB; T {T}, forward+backward fp32, "
        f"projections included in both, top-k {SHAPE['topk']}, outputs agree to {err:.1e} at T {check_T})"
    )


def main(threads: int = 2, iters: int = 3, T: int = 8192, baseline: Optional[str] = None) -> List[str]:
    from benchmarks.harness import machine_line, run_variant

    # Beyond top-k, keys whose ReLU index scores are all exactly 0 tie, and the two top-k calls break those
    # ties differently (both correct); up to top-k every visible key is selected, so outputs must agree.
    check_T = min(T, SHAPE["topk"])
    err = check_same_output(check_T)
    if err > 1e-4:
        raise RuntimeError(f"ours and transformers disagree: relative difference {err:.2e}")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("ours", "benchmarks.ops_dsa:ours_step", {})]
        if baseline is not None:
            variants.append(("base", "benchmarks.ops_dsa:ours_step", {"root": _archive(baseline, tmp)}))
        variants.append(("hf", "benchmarks.ops_dsa:hf_step", {}))
        for key, target, extra in variants:
            res[key] = run_variant(target, threads=threads, iters=iters, T=T, **extra)
            if "error" in res[key]:
                raise RuntimeError(f"{key}: {res[key]['error']}")
    ours, hf = res["ours"], res["hf"]
    reads = host_reads_per_step(T)
    lines = [machine_line(threads), _vs_line("", ours, hf, T, err, check_T)]
    if baseline is not None:
        base = res["base"]
        lines.append(_vs_line(f" at {baseline}", base, hf, T, err, check_T))
        lines.append(
            f"dsa sparse, this tree vs {baseline}: {base['seconds'] / ours['seconds']:.2f}x faster, memory "
            f"{ours['peak_mib'] / max(base['peak_mib'], 1e-9):.2f}x (this tree {ours['seconds']:.2f} s "
            f"+{ours['peak_mib']:.0f} MiB, {baseline} {base['seconds']:.2f} s +{base['peak_mib']:.0f} MiB)"
        )
    listed = ", ".join(f"{call} {n}" for call, n in reads.items()) or "none"
    lines.append(
        f"dsa host reads per forward+backward (indexer_topk + sparse_attention, T {T}): {sum(reads.values())} "
        f"({listed})"
    )
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="a commit whose moe_plugin is timed side by side")
    args = parser.parse_args()
    main(threads=args.threads, iters=args.iters, T=args.T, baseline=args.baseline)
