"""The trainer as a user runs it: recipes through ``train`` in one process, and through the deepspeed and
torchrun launchers on 2 processes; what it writes loads with plain peft / transformers and gives back the
evaluation loss the trainer reported (an independent check of every exported name and expert stacking)."""

from __future__ import annotations

import pytest
import json
import math
import os

import torch

from moe_plugin.training.data.pipeline import eval_batches, label_token_count, load_examples, pack_examples
from moe_plugin.training.loop import train
from moe_plugin.recipe.schema import recipe_from_dict
from tests.recipes import EXPERTS, ZERO3, minimal, whole
from tests.training.launchers import BIN, REPO, free_port, launch, torchrun


def _mean(xs):
    return sum(xs) / len(xs)


def _recipe(path: str, **changes) -> dict:
    with open(os.path.join(REPO, path)) as f:
        values = json.load(f)
    for section, update in changes.items():
        if isinstance(update, dict) and isinstance(values.get(section), dict):
            values[section].update(update)
        else:
            values[section] = update
    return values


@torch.no_grad()
def hf_eval_loss(model, recipe: dict, world: int = 0) -> float:
    """The held-out loss as the trainer computes it on ``world`` processes (0: 2 with a DeepSpeed config, else 1),
    with a Hugging Face model."""
    r = recipe_from_dict(recipe)
    _, held_out = load_examples(r.data, r.seed)
    rows = pack_examples(held_out, r.data.seq_len, r.data.pack)
    world = world or (2 if r.deepspeed else 1)
    total, count = 0.0, 0
    for micro in eval_batches(rows, r.schedule.micro_batch_size, r.eval.batches * world):
        out = model(input_ids=micro.input_ids, labels=micro.labels, cu_seqlens=micro.cu_seqlens, num_items_in_batch=1)
        total += float(out.loss)
        count += label_token_count(micro.labels, micro.cu_seqlens)
    return total / count


def load_adapter(output_dir: str):
    """Plain peft, from another working directory: the base path is in the adapter's config."""
    from peft import PeftModel

    from moe_plugin.models import MoEPluginForCausalLM

    adapter = os.path.join(output_dir, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    assert os.path.isabs(base)
    cwd = os.getcwd()
    os.chdir("/")
    try:
        model = PeftModel.from_pretrained(MoEPluginForCausalLM.from_pretrained(base), adapter).eval()
    finally:
        os.chdir(cwd)
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved, loaded = load_file(os.path.join(adapter, "adapter_model.safetensors")), get_peft_model_state_dict(model)
    assert sorted(saved) == sorted(loaded)  # every adapter tensor of the file landed in the model
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    return model


def test_arithmetic_recipe_fine_tunes_the_shipped_text_base(tmp_path):
    recipe = _recipe(
        "recipes/tiny_lora_arith.json",
        output_dir=str(tmp_path / "lora"),
        schedule={"steps": 30},
        logging={"every": 10, "progress_bar": False},
    )
    result = train(recipe_from_dict(recipe))
    assert len(result.losses) == 30 and _mean(result.losses[-5:]) < 0.8 * result.losses[0], result.losses
    with open(tmp_path / "lora" / "losses.json") as f:
        assert json.load(f) == result.losses
    assert math.isclose(hf_eval_loss(load_adapter(str(tmp_path / "lora")), recipe), result.eval_loss, rel_tol=1e-5)


def test_megatron_full_parameter_training_exports_a_hugging_face_model(tmp_path):
    from moe_plugin.models import MoEPluginForCausalLM

    recipe = minimal(
        tmp_path / "full",
        seed=2,
        lora=None,
        data={"num_documents": 300, "seq_len": 64},
        parallel={"backend": "megatron"},
        schedule={"steps": 20, "lr": 3e-3},
    )
    result = train(recipe_from_dict(recipe))
    assert _mean(result.losses[-5:]) < 0.8 * result.losses[0], result.losses
    model = MoEPluginForCausalLM.from_pretrained(str(tmp_path / "full" / "model")).eval()
    assert math.isclose(hf_eval_loss(model, recipe), result.eval_loss, rel_tol=1e-5)


def test_megatron_lora_with_expert_adapters_loads_in_plain_peft(tmp_path):
    recipe = minimal(
        tmp_path / "lora",
        seed=4,
        lora={"r": 4, "alpha": 8, "target_parameters": EXPERTS},
        data={"num_documents": 300, "seq_len": 64},
        parallel={"backend": "megatron"},
        schedule={"steps": 8, "lr": 1e-2},
    )
    result = train(recipe_from_dict(recipe))
    model = load_adapter(str(tmp_path / "lora"))
    assert math.isclose(hf_eval_loss(model, recipe), result.eval_loss, rel_tol=1e-5)


def test_chat_sft_data(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(20)
        for b in range(10)
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    recipe = minimal(
        tmp_path / "out",
        data={"kind": "sft", "path": str(path), "seq_len": 64},
        parallel={"backend": "hf"},
        schedule={"steps": 3},
    )
    result = train(recipe_from_dict(recipe))
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_then_torchrun_resume(tmp_path):
    """2 CPU processes, megatron EP=2: the deepspeed launcher runs 2 steps with ZeRO-3, torchrun continues the
    same output_dir to 4 from its checkpoint under FSDP2 (``parallel.sharding``, no DeepSpeed config), and the
    adapter the FSDP2 run wrote reproduces the reported evaluation loss in plain peft on one process."""
    recipe = minimal(
        tmp_path / "run",
        seed=5,
        deepspeed=ZERO3,
        lora={"r": 4, "alpha": 8, "target_parameters": EXPERTS},
        data={"num_documents": 300, "seq_len": 64},
        parallel={"backend": "megatron", "expert_parallel_size": 2},
        schedule={"steps": 2, "micro_batch_size": 1, "lr": 1e-2},
        logging=whole({"every": 1}),
    )
    first = tmp_path / "first.json"
    first.write_text(json.dumps(recipe))
    out = launch(
        [
            os.path.join(BIN, "deepspeed"),
            "--num_accelerators",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "moe_plugin.train",
            "--recipe",
            str(first),
        ]
    )
    assert "expert parallel 2, ZeRO stage 3" in out
    recipe["schedule"]["steps"] = 4
    recipe["deepspeed"], recipe["parallel"]["sharding"] = None, "fsdp2"
    second = tmp_path / "second.json"
    second.write_text(json.dumps(recipe))
    out = launch(torchrun(2, "-m", "moe_plugin.train", "--recipe", str(second)))
    assert "resuming from the checkpoint at step 2" in out and "expert parallel 2, FSDP2 over 2 ranks" in out
    assert "written at 2 processes EP 2 under zero3 on 2 processes EP 2 under fsdp2" in out
    with open(tmp_path / "run" / "losses.json") as f:
        losses = json.load(f)
    assert len(losses) == 4
    with open(tmp_path / "run" / "results.json") as f:
        reported = json.load(f)
    assert reported["resumed_from"] == 2 and reported["steps"] == 4
    adapter = load_adapter(str(tmp_path / "run"))
    assert math.isclose(hf_eval_loss(adapter, recipe, world=2), reported["eval_loss"], rel_tol=1e-5)
