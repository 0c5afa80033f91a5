"""A training step of the whole model on the CPU: ours vs transformers 5.24's KimiLinearForCausalLM and
Glm5NextTextModel (+ the same lm_head and cross entropy), at one shape, each variant in a fresh process.

Shape (all three models): hidden 128, 4 layers (3 KDA + 1 full attention, in that order), 4 heads of 32 in
both attention kinds, 16 routed experts top-4 of width 64 plus one shared expert of width 64 in every layer
(no dense first layer), vocabulary 512, batch 2 x 256 tokens, fp32, SwiGLU, sigmoid routing without groups.
Full attention: kv latent 64, q latent 64, qk 32 (no position part), v 32. Our model runs without the
latent MoE projection, without Attention Residuals, with the DSA indexer off (K3's layout; Kimi-Linear has no
indexer) and with its MLA output gate on (K3's; the others have none). Glm5Next keeps its DSA indexer (4 x 32
heads, top-2048, so dense at this length) and runs with one hyper-connection stream (``hc_mult=1``).

Two modes, each an optimizer step on a next-token loss:
- ``full``: every parameter trained with AdamW;
- ``lora``: peft LoRA r=8 on the seed's targets, everything else frozen. Names per model: ours
  ``q_proj``, ``k_proj`` (KDA) and ``gate`` (the router, an nn.Linear); Kimi-Linear and Glm5Next ``q_proj``,
  ``k_proj`` (their KDA) and their router weight ``mlp.gate.weight`` through ``target_parameters`` (their
  routers are not nn.Linear).

``python -m benchmarks.model_train`` prints one line per mode; ``main()`` returns the lines.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

SHAPE = dict(hidden=128, heads=4, head_dim=32, experts=16, top_k=4, width=64, vocab=512, batch=2, seq=256)
LORA_RANK = 8
LORA_TARGETS = {  # (target_modules, target_parameters)
    "ours": (["q_proj", "k_proj", "gate"], []),
    "kimi_linear": (["q_proj", "k_proj"], ["mlp.gate.weight"]),
    "glm5_next": (["q_proj", "k_proj"], ["mlp.gate.weight"]),
}
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _ours(hidden, heads, head_dim, experts, top_k, width, vocab, **_):
    from moe_plugin.models import MoEPluginConfig, MoEPluginForCausalLM

    config = MoEPluginConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        hidden_act="swiglu",
        attn_res=False,
        linear_attn_config=dict(num_heads=heads, head_dim=head_dim, gate_rank=head_dim),
        num_attention_heads=heads,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=0,
        v_head_dim=head_dim,
        use_dsa_indexer=False,
        num_experts=experts,
        num_experts_per_token=top_k,
        num_shared_experts=1,
        moe_intermediate_size=width,
        routed_expert_hidden_size=None,
        first_k_dense_replace=0,
    )
    return MoEPluginForCausalLM(config)


def _peer_config(hidden, heads, head_dim, top_k, width, vocab):
    """The keys KimiLinear and Glm5Next spell alike, at the benchmark's shape (their expert-count key differs)."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        mlp_layer_types=["sparse"] * 4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=0,
        v_head_dim=head_dim,
        num_experts_per_tok=top_k,
        n_shared_experts=1,
        moe_intermediate_size=width,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        pad_token_id=0,
    )


def _kimi_linear(hidden, heads, head_dim, experts, top_k, width, vocab, **_):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        **_peer_config(hidden, heads, head_dim, top_k, width, vocab),
        num_local_experts=experts,
        bos_token_id=1,
        eos_token_id=2,
    )
    return KimiLinearForCausalLM(config)


class _Glm5NextWithHead(torch.nn.Module):
    """Glm5NextTextModel has no output layer: the same lm_head and loss as the other two."""

    def __init__(self, model, hidden, vocab):
        super().__init__()
        self.model = model
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        from moe_plugin.ops.losses import causal_lm_loss

        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return causal_lm_loss(self.lm_head(hidden), labels)


def _glm5_next(hidden, heads, head_dim, experts, top_k, width, vocab, **_):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = Glm5NextTextConfig(
        **_peer_config(hidden, heads, head_dim, top_k, width, vocab),
        n_routed_experts=experts,
        index_n_heads=heads,
        index_head_dim=head_dim,
        hc_mult=1,
    )
    return _Glm5NextWithHead(Glm5NextTextModel(config), hidden, vocab)


BUILDERS: Dict[str, Callable] = {"ours": _ours, "kimi_linear": _kimi_linear, "glm5_next": _glm5_next}


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out if torch.is_tensor(out) else out.loss


def train_step(model_name: str = "ours", mode: str = "full", seed: int = 0, **shape):
    """``setup`` for ``harness.run_variant``: builds the model and returns one training step (fwd, bwd, AdamW)."""
    from peft import LoraConfig, get_peft_model

    kw = dict(SHAPE, **shape)
    torch.manual_seed(seed)
    model = BUILDERS[model_name](**kw)
    if mode == "lora":
        modules, params = LORA_TARGETS[model_name]
        model = get_peft_model(
            model,
            LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=modules, target_parameters=params or None),
        )
    elif mode != "full":
        raise ValueError(f"mode: expected 'full' or 'lora', got {mode!r}")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, kw["vocab"], (kw["batch"], kw["seq"]))

    def step():
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def tiny_lora_step(seq: int = 256):
    """``setup``: one LoRA training step (seed targets) of the ``tiny`` preset on ``seq`` tokens."""
    import moe_plugin
    from moe_plugin.lora import add_lora, lora_config

    torch.manual_seed(0)
    model = add_lora(moe_plugin.MoEPluginForCausalLM(moe_plugin.preset_config("tiny")), lora_config(), wrap=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 256, (1, seq))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(threads: int = 2, iters: int = 3, **shape) -> List[str]:
    from benchmarks.harness import machine_line, run_variant

    kw = dict(SHAPE, **shape)
    tokens = kw["batch"] * kw["seq"]
    lines = [machine_line(threads)]
    for mode in ("full", "lora"):
        results = {}
        for name in BUILDERS:
            res = run_variant(
                "benchmarks.model_train:train_step", threads=threads, iters=iters, model_name=name, mode=mode, **shape
            )
            if "error" in res:
                raise RuntimeError(f"{name} ({mode}): {res['error']}")
            results[name] = res
        ours = results["ours"]["seconds"]
        parts = [f"{name} {tokens / r['seconds']:,.0f} tokens/s {r['peak_mib']:.0f} MiB" for name, r in results.items()]
        speedups = ", ".join(f"{results[n]['seconds'] / ours:.2f}x vs {n}" for n in BUILDERS if n != "ours")
        lines.append(
            f"train step ({mode}{', LoRA r=%d' % LORA_RANK if mode == 'lora' else ', AdamW'}): "
            f"ours {speedups}; "
            + "; ".join(parts)
            + f" (hidden {kw['hidden']}, 3 KDA + 1 MLA, {kw['heads']}x{kw['head_dim']} heads, "
            f"{kw['experts']} experts top-{kw['top_k']} width {kw['width']} + 1 shared, vocab "
            f"{kw['vocab']}, batch {kw['batch']}x{kw['seq']}, fp32)"
        )
    tiny = run_variant("benchmarks.model_train:tiny_lora_step", threads=threads, iters=max(iters, 5))
    lines.append(
        f"tiny preset, LoRA step (q_proj, k_proj, gate) on 256 tokens: {tiny['seconds'] * 1e3:.0f} ms "
        f"(goal: well under 1 s)"
    )
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    from benchmarks.harness import write_results

    write_results("model training step (benchmarks/model_train.py)", main())
