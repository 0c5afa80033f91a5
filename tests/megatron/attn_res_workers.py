"""Rank-side code of test_megatron_attn_res.py, run by moe_plugin.testing.launch.run_distributed.

Two checks per launch, each on the checkpoint the parent saved (Attention Residuals with nonzero mixing points,
the DSA indexer with a LoRA'd indexer and ``indexer_loss_coeff`` > 0):

* ``direct``: megatron's GPTModel at EP=1, no ZeRO, built from the specs, the checkpoint and the parent's
  adapters loaded; forward/backward of this rank's micro-batch with the indexer term; gradients reduced.
* ``trainer``: the product's ``Trainer`` (megatron backend, EP=2 x ZeRO-3 over all ranks) from the same
  checkpoint. One step moves the adapters off their start (peft's ``lora_B`` is zero); the second step is
  recorded: the adapters before it, each rank's micro-batch and logits, the loss and the reduced gradients.

Nothing here asserts; the parent compares with the Hugging Face model on the concatenated batch.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

from tests.training.trainer_workers import _full_grads  # every adapter's reduced gradient, PEFT names


def _guarded(check) -> dict:
    try:
        out = check()
    except Exception:
        out = {"error": traceback.format_exc()}
        print(f"rank {dist.get_rank()}: {out['error']}", file=sys.stderr, flush=True)
    dist.barrier()
    return out


def _direct(case_dir: str) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from moe_plugin.lora import add_lora, lora_config
    from moe_plugin.megatron.adapters import indexer_loss_of
    from moe_plugin.megatron.attn_res_block import AttnResTransformerBlock
    from moe_plugin.megatron.lora import adapter_state_to_hf
    from moe_plugin.megatron.specs import build_gpt_model
    from moe_plugin.models.configuration import MoEPluginConfig
    from moe_plugin.ops.losses import causal_lm_loss
    from moe_plugin.testing.grad_reduce import reduce_gradients
    from moe_plugin.testing.megatron_loading import load_hf_adapter_state, load_hf_checkpoint

    path = os.path.join(case_dir, "base")
    setup = torch.load(os.path.join(case_dir, "setup.pt"))
    hf = MoEPluginConfig.from_pretrained(path)
    config = hf.to_model_config()
    model = build_gpt_model(config, indexer_loss=True)
    load_hf_checkpoint(model, path, config)
    lora = setup["lora"]
    add_lora(model, lora_config(lora["r"], lora["alpha"], lora["target_modules"], lora["target_parameters"]))
    load_hf_adapter_state(model, setup["adapters"], config)
    model.train()
    ids, labels, cu = setup["batches"][dist.get_rank()]
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    logits = model(ids, None, None, packed_seq_params=params)
    lm = causal_lm_loss(logits, labels, cu, setup["num_items"] / dist.get_world_size())
    indexer_kl = indexer_loss_of(model)
    loss = lm + hf.indexer_loss_coeff * indexer_kl
    loss.backward()
    reduce_gradients(model)
    return {
        "block": type(model.decoder).__name__ == AttnResTransformerBlock.__name__,
        "names": sorted(n for n, _ in model.named_parameters() if "_res_proj" in n or "_res_norm" in n),
        "logits": logits.detach(),
        "lm": lm.detach(),
        "indexer_kl": indexer_kl.detach(),
        "grads": adapter_state_to_hf(model, config, grads=True),
    }


def _trainer(recipe_dict: dict) -> dict:
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    with Trainer(recipe_from_dict(copy.deepcopy(recipe_dict))) as trainer:
        first = trainer.train_step()
        out = {
            "first_loss": first,
            "adapters": trainer.backend.adapter_state(trainer.engine.module),
            "ep": trainer.layout.expert,
            "zero3": trainer.engine.zero3,
        }
        seen = {"batches": [], "logits": [], "metrics": []}
        loss_fn, module = trainer.backend.loss, trainer.engine.module
        forward = module.forward

        def recording_forward(*args, **kwargs):
            logits = forward(*args, **kwargs)
            seen["logits"].append(logits.detach().clone())
            return logits

        def recording_loss(engine, micro, num_items):
            seen["batches"].append((micro.input_ids, micro.labels, micro.cu_seqlens, num_items))
            loss, metrics = loss_fn(engine, micro, num_items)
            seen["metrics"].append({k: v.clone() for k, v in metrics.items()})
            return loss, metrics

        module.forward, trainer.backend.loss = recording_forward, recording_loss
        grads = {}
        out["loss"] = trainer.train_step(on_gradients=lambda: grads.update(_full_grads(trainer)))
        out.update(seen, grads=grads)
        out["partitioned"] = sorted(
            n for n, p in module.named_parameters() if ("_res_proj" in n or "_res_norm" in n) and hasattr(p, "ds_id")
        )
    return out


def run_checks(case_dir: str, recipe: dict) -> dict:
    from moe_plugin.parallel.distributed import initialize_megatron

    from megatron.core import parallel_state

    initialize_megatron(expert_model_parallel_size=1, seed=1)
    results = {"direct": _guarded(lambda: _direct(case_dir))}
    parallel_state.destroy_model_parallel()
    results["trainer"] = _guarded(lambda: _trainer(recipe))
    return results
