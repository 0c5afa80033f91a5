"""``python -m moe_plugin.train --recipe recipes/tiny_lora.json``: a LoRA fine-tune from a recipe.

Single process on CPU or one GPU; the DeepSpeed launcher path builds on this entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List

import torch
from torch import nn

from .fileio import atomic_directory
from .models import MoEPluginForCausalLM, preset_config
from .models.tokenizer import ByteTokenizer
from .training.data import arithmetic_documents, batches, jsonl_documents, pack_documents
from .training.lora import apply_lora, count_parameters
from .training.recipe import Recipe, load_recipe
from .training.routing import RoutingDriftMonitor, balance_experts, moe_layers


def build_model(recipe: Recipe) -> MoEPluginForCausalLM:
    if recipe.model.from_pretrained:
        return MoEPluginForCausalLM.from_pretrained(recipe.model.from_pretrained, **recipe.model.overrides)
    return MoEPluginForCausalLM(preset_config(recipe.model.preset, **recipe.model.overrides))


def parameter_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """AdamW groups: no weight decay for vectors (norms, biases) and parameters marked ``_no_weight_decay``
    (KDA's ``A_log`` and ``dt_bias``, ARCHITECTURE.md 2.1)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(recipe: Recipe) -> Dict[str, List[float]]:
    """Run the recipe; returns the per-step losses and writes the adapter (or, with ``"lora": null``, the
    whole model) and the tokenizer to ``train.output_dir``, replacing it only once everything is written."""
    cfg = recipe.train
    torch.manual_seed(cfg.seed)
    tokenizer = ByteTokenizer()
    model = build_model(recipe)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model.overrides.vocab_size: the tokenizer needs {tokenizer.vocab_size} ids, "
                         f"the model has {model.config.vocab_size}")
    full = recipe.lora is None
    if not full:
        model = apply_lora(model, recipe.lora)
    trainable, total = count_parameters(model)
    docs = (arithmetic_documents(recipe.data.num_documents, cfg.seed, recipe.data.operation)
            if recipe.data.kind == "arithmetic" else jsonl_documents(recipe.data.path))
    token_docs = [[tokenizer.bos_token_id] + tokenizer.encode(d, add_special_tokens=False)
                  + [tokenizer.eos_token_id] for d in docs]
    data = batches(pack_documents(token_docs, recipe.data.seq_len), cfg.micro_batch_size, cfg.seed)
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr)
    drift = RoutingDriftMonitor(model)
    source = recipe.model.from_pretrained or f"preset {recipe.model.preset}"
    what = ("every parameter" if full else
            f"LoRA r={recipe.lora.r} on {recipe.lora.target_modules + recipe.lora.target_parameters}")
    print(f"model: {source}, {total:,} parameters, {trainable:,} trainable ({what})")
    losses: List[float] = []
    model.train()
    start = time.perf_counter()
    tokens = 0
    for step in range(1, cfg.steps + 1):
        ids, cu_seqlens = next(data)
        out = model(input_ids=ids, labels=ids, cu_seqlens=cu_seqlens)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # the loads the MoE layers summed over this step's forwards; the selection bias is a base weight,
        # balanced only when the base trains (frozen under LoRA)
        loads = [layer.pop_load() for layer in moe_layers(model)]
        imbalance = balance_experts(model, torch.stack(loads)) if full and loads and loads[0] is not None else None
        losses.append(out.loss.item())
        tokens += ids.numel()
        if step % cfg.log_every == 0 or step == 1 or step == cfg.steps:
            line = f"step {step:4d}  loss {losses[-1]:.4f}  {tokens / (time.perf_counter() - start):,.0f} tokens/s"
            if out.indexer_loss is not None:
                line += f"  (indexer KL {out.indexer_loss.item():.4f} included)"
            if imbalance is not None:
                line += f"  expert load max/mean {imbalance:.2f}"
            routing_drift = drift.pop()
            if routing_drift is not None:
                line += f"  routing drift from base {routing_drift:.1%}"
            print(line)
        else:
            drift.pop()
    drift.close()
    with atomic_directory(cfg.output_dir) as tmp:
        model.save_pretrained(tmp)  # the adapter alone with LoRA, the whole model without
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "losses.json"), "w") as f:
            json.dump(losses, f)
    print(f"done: loss {losses[0]:.4f} -> {sum(losses[-5:]) / len(losses[-5:]):.4f} (mean of last 5) in "
          f"{cfg.steps} steps; {'model' if full else 'adapter'} saved to {cfg.output_dir}")
    return {"losses": losses}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", required=True, help="path to a recipe JSON (see recipes/)")
    args = parser.parse_args(argv)
    train(load_recipe(args.recipe))


if __name__ == "__main__":
    main()
