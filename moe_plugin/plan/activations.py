"""Activation memory of one micro-batch: what autograd keeps for backward, measured on the implementation and
extended to any size (docs/planner.md, "Activations").

The bytes a layer saves for backward are a sum of monomials in its sizes (tokens x width, tokens x heads x
chunk, experts x width x width, ...). Which tensors are saved is the implementation's business (recomputation
in the SiTU activation and in the attention blocks, a concatenated expert weight, LoRA's inputs, peft's
wrappers), so the planner does not write that list down: it runs small models of the recipe's own structure
(same layer kinds, expert format, Attention Residuals, LoRA targets) forward on the CPU with
``torch.autograd.graph.saved_tensors_hooks``, attributes every saved storage to a segment (a layer's attention
side, its MLP side, its Attention-Residual mixing, the head and loss), and fits each segment's coefficients
over the monomials below by least squares. The fit must be exact (``max_rel_residual``, printed by the plan):
a monomial missing from a basis shows up there instead of as a silently wrong number.

The routed experts are dispatched with the routing of a trained router taken as balanced: each expert
receives ``tokens x top_k / experts`` rows times ``capacity`` (a stated assumption, 1.25 by default), so the
dispatched monomials scale by the capacity factor.
"""

from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

__all__ = ["SEGMENTS", "ActivationModel", "fit_activation_model", "segment_dims"]

# segment -> (monomial names); each monomial is a function of the dims dict (see _monomials)
SEGMENTS: Dict[str, Tuple[str, ...]] = {
    "kda": ("N", "N*D", "N*P", "N*H", "N*H*C", "N*H*K*K/C", "N*P/C", "N*R", "B*H*K*K"),
    "mla": ("N", "N*D", "N*H*Q", "N*H*V", "N*QR", "N*KR", "N*H", "N*T", "N*IH*ID", "N*ID", "N*IH", "N*ITK"),
    "moe": ("N", "N*D", "N*L", "Nk*L", "Nk*F", "N*E", "Nk", "N*FS", "El*F*L", "El*F", "El*L", "El"),
    "mlp": ("N", "N*D", "N*FD"),
    "attn_res": ("N", "N*D", "N*D*c", "N*c"),
    "head": ("N", "N*D", "N*Vo"),
}
DISPATCHED = ("Nk*L", "Nk*F", "Nk")  # scaled by the capacity factor


def _monomial(name: str, d: Dict[str, float]) -> float:
    value = 1.0
    for factor in name.replace("/", "*/").split("*"):
        if factor.startswith("/"):
            value /= d[factor[1:]]
        else:
            value *= d[factor]
    return value


def _structure_dims(mc) -> Dict[str, float]:
    """Sizes of the model config (``ModelConfig``) that do not depend on the batch."""
    k, m, e = mc.kda, mc.mla, mc.moe
    out = dict(D=mc.hidden_size, Vo=mc.vocab_size, H=k.num_heads, K=k.head_dim, P=k.num_heads * k.head_dim,
               C=k.chunk_size, R=k.gate_rank, QH=m.num_heads, Q=m.qk_head_dim, V=m.v_head_dim,
               QR=m.q_lora_rank or 0, KR=m.kv_lora_rank + m.qk_rope_head_dim,
               IH=getattr(m, "index_n_heads", 0) if getattr(m, "use_indexer", False) else 0,
               ID=getattr(m, "index_head_dim", 0) if getattr(m, "use_indexer", False) else 0,
               TK=getattr(m, "index_topk", 0) if getattr(m, "use_indexer", False) else 0,
               E=e.num_experts, k=e.top_k, L=e.expert_dim, F=e.expert_intermediate_size,
               FS=e.shared_intermediate_size if e.num_shared_experts else 0, FD=mc.dense_intermediate_size)
    return out


def segment_dims(mc, batch: int, seq_len: int, local_experts: int, capacity: float, segment: str,
                 candidates: int = 0) -> Dict[str, float]:
    """The dims dict of one segment at a micro-batch of ``batch`` rows of ``seq_len`` tokens."""
    d = _structure_dims(mc)
    n = batch * seq_len
    d.update(B=batch, T=seq_len, N=n, Nk=n * d["k"], El=local_experts, c=candidates,
             ITK=min(d["TK"], seq_len) if d["TK"] else 0)
    if segment == "mla":
        d["H"] = d["QH"]
    return d


@dataclass
class ActivationModel:
    """Fitted bytes per monomial for each segment; ``bytes(segment, dims)`` evaluates one segment."""

    coefficients: Dict[str, Dict[str, float]]
    max_rel_residual: float
    probes: int

    def bytes(self, segment: str, dims: Dict[str, float], capacity: float = 1.0) -> float:
        total = 0.0
        for name, coef in self.coefficients.get(segment, {}).items():
            value = _monomial(name, dims)
            total += coef * value * (capacity if name in DISPATCHED else 1.0)
        return max(total, 0.0)


def attn_res_candidates(layer: int, block_size: int) -> Tuple[int, int]:
    """Candidates at a layer's two mixing points: the embedding, the completed blocks, the partial sum."""
    done = layer // block_size
    starts = layer % block_size == 0
    return 1 + done + (0 if starts else 1), 2 + done


def final_candidates(num_layers: int, block_size: int) -> int:
    return 1 + num_layers // block_size + (1 if num_layers % block_size else 0)


def _probe_config(hf_dict: dict, rng: random.Random):
    """A 3-layer model of the recipe's structure (a KDA layer with the dense MLP, a KDA and an MLA layer
    with MoE) at random small sizes."""
    from ..models.configuration import MoEPluginConfig

    d = dict(hf_dict)
    heads, head_dim, chunk = rng.choice([1, 2, 3]), rng.choice([8, 16, 24]), rng.choice([8, 16])
    lin = dict(d.get("linear_attn_config") or {})
    lin.update(num_heads=heads, head_dim=head_dim, chunk_size=chunk, gate_rank=rng.choice([4, 8, 12]))
    e = rng.choice([4, 6, 8])
    idx = bool(d.get("use_dsa_indexer"))
    d.update(vocab_size=rng.choice([64, 96, 160]), hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=3,
             layer_types=["kda", "kda", "mla"], linear_attn_config=lin, first_k_dense_replace=1,
             attn_res_block_size=2, num_attention_heads=rng.choice([1, 2, 3]), q_lora_rank=rng.choice([16, 24]),
             kv_lora_rank=rng.choice([8, 16]), qk_nope_head_dim=rng.choice([8, 16]),
             qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 12]),
             num_experts=e, num_experts_per_token=rng.choice([1, 2, 3]), num_shared_experts=rng.choice([1, 2]),
             moe_intermediate_size=rng.choice([32, 64]), routed_expert_hidden_size=rng.choice([32, 64]),
             intermediate_size=rng.choice([32, 64, 96]), index_n_heads=rng.choice([1, 2]) if idx else 1,
             index_head_dim=rng.choice([8, 16]) if idx else 8, index_topk=rng.choice([8, 24]) if idx else 8,
             num_expert_group=1, topk_group=1)
    d.pop("vision_config", None)
    for key in ("architectures", "transformers_version", "model_type", "auto_map", "quantization_config"):
        d.pop(key, None)
    return MoEPluginConfig(**{k: v for k, v in d.items() if k in _init_keys()}), chunk


def _init_keys():
    import inspect

    from transformers import PretrainedConfig

    from ..models.configuration import MoEPluginConfig

    return (set(inspect.signature(MoEPluginConfig.__init__).parameters)
            | set(inspect.signature(PretrainedConfig.__init__).parameters)) - {"self", "kwargs"}


def _segment_of(module_path: str, layer_kinds: Sequence[Tuple[str, bool]]) -> Tuple[str, int]:
    parts = module_path.split(".")
    if "layers" not in parts:
        return "head", -1
    i = int(parts[parts.index("layers") + 1])
    rest = parts[parts.index("layers") + 2:]
    if not rest or rest[0].endswith(("_res_proj", "_res_norm")):
        return "attn_res", i
    if rest[0] in ("input_layernorm", "self_attn"):
        return layer_kinds[i][0], i
    return ("moe" if layer_kinds[i][1] else "mlp"), i


def probe_saved_bytes(model, batch: int, seq_len: int) -> Dict[Tuple[str, int], int]:
    """Bytes autograd saves for backward in one forward+loss of ``model`` (a ``MoEPluginForCausalLM`` on the
    CPU), per (segment, layer index); parameter and buffer storages excluded, each storage counted once."""
    mc = model.config.to_model_config()
    kinds = [(t, mc.is_moe_layer(i)) for i, t in enumerate(mc.layer_types)]
    stack: List[str] = ["head"]
    handles = []
    for name, module in model.named_modules():
        if ".layers." in f".{name}" or name.endswith(("norm", "lm_head", "embed_tokens")):
            handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n)))
            handles.append(module.register_forward_hook(lambda *_: (stack.pop(), None)[1]))
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen, out = set(), collections.Counter()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            out[_segment_of(stack[-1], kinds)] += t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, mc.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    return dict(out)


def _balanced_permute(x, indices, num_experts):
    # every expert gets the same share of the token copies, as the planner's capacity assumption states
    from ..ops.moe import permute as real

    n, k = indices.shape
    return real(x, (torch.arange(n * k, device=x.device) % num_experts).view(n, k), num_experts)


def fit_activation_model(hf_config, lora_section, probes: int = 14, seed: int = 0,
                         progress: Callable[[str], None] = lambda _: None) -> ActivationModel:
    """Fit ``SEGMENTS``' coefficients on ``probes`` small models shaped like ``hf_config`` (fp32)."""
    import numpy as np

    from ..layers import moe as moe_layer
    from ..lora import add_lora, lora_config
    from ..models import MoEPluginForCausalLM

    rng = random.Random(seed)
    rows: Dict[str, List[Tuple[List[float], float]]] = collections.defaultdict(list)
    base = hf_config.to_dict()
    real_permute = moe_layer.permute
    moe_layer.permute = _balanced_permute
    try:
        for p in range(probes):
            cfg, chunk = _probe_config(base, rng)
            torch.manual_seed(p)
            model = MoEPluginForCausalLM(cfg).float()
            if lora_section is not None:
                for param in model.parameters():
                    param.requires_grad_(False)
                add_lora(model, lora_config(lora_section.r, lora_section.alpha, lora_section.target_modules,
                                            lora_section.target_parameters, lora_section.dropout))
            batch, seq = rng.choice([1, 2]), chunk * rng.choice([2, 3, 5])
            measured = probe_saved_bytes(model, batch, seq)
            mc = cfg.to_model_config()
            collected: Dict[Tuple[str, int], float] = collections.Counter(measured)
            for i in range(mc.num_layers):
                for seg in (mc.layer_types[i], "moe" if mc.is_moe_layer(i) else "mlp"):
                    collected.setdefault((seg, i), 0.0)
                if mc.attn_res:
                    collected.setdefault(("attn_res", i), 0.0)
            for (seg, i), value in collected.items():
                cands = 0
                if seg == "attn_res" and mc.attn_res:
                    cands = sum(attn_res_candidates(i, mc.attn_res_block_size))
                elif seg == "head" and mc.attn_res:
                    cands = final_candidates(mc.num_layers, mc.attn_res_block_size)
                dims = segment_dims(mc, batch, seq, mc.moe.num_experts, 1.0, seg, cands)
                rows[seg].append(([_monomial(m, dims) for m in SEGMENTS[seg]], float(value)))
            progress(f"probe {p + 1}/{probes}")
    finally:
        moe_layer.permute = real_permute
    coefficients, worst = {}, 0.0
    for seg, data in rows.items():
        a = np.array([r[0] for r in data])
        b = np.array([r[1] for r in data])
        scale = np.maximum(np.abs(a).max(axis=0), 1.0)
        coef, *_ = np.linalg.lstsq(a / scale, b, rcond=None)
        coef = coef / scale
        fitted = a @ coef
        big = b > 0.01 * max(b.max(), 1.0)
        if big.any():
            err = float(np.max(np.abs(fitted[big] - b[big]) / b[big]))
            progress(f"{seg}: max relative residual {err:.3f} over {len(b)} rows")
            worst = max(worst, err)
        coefficients[seg] = {m: float(c) for m, c in zip(SEGMENTS[seg], coef) if abs(c) > 1e-6}
    return ActivationModel(coefficients, worst, probes)
