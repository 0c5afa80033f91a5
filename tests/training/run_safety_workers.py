"""Helpers of test_run_safety.py: the planted payload, small bases, and the rank-side code of its 2-process
launch (EP=2 x ZeRO-3, megatron backend). Nothing here asserts: each case returns what the parent checks."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


class Payload:
    """Unpickling this creates ``path``: what a crafted checkpoint file would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant(checkpoint: str, relative: str, sentinel: str) -> None:
    """Replace ``checkpoint/relative`` by a torch file holding a payload, and update the COMPLETE marker's size
    for it (so the checkpoint still counts as complete, as a crafted one would)."""
    path = os.path.join(checkpoint, relative)
    torch.save({"module": Payload(sentinel)}, path)
    marker = os.path.join(checkpoint, "COMPLETE")
    with open(marker) as f:
        values = json.load(f)
    values["files"][relative] = os.path.getsize(path)
    with open(marker, "w") as f:
        json.dump(values, f)


# helpers of the one-process cases


def fake_base(path: Path, values: float) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "moe_plugin", "hidden_size": 8}))
    save_file({"w": torch.full((64, 512), values), "b": torch.zeros(8)}, str(path / "model.safetensors"))


def payload_file(path: Path, sentinel: Path) -> None:
    torch.save({"optimizer": Payload(str(sentinel))}, str(path))


def digests(directory) -> dict:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }


def save_base(path: Path, seed: int) -> None:
    from moe_plugin.models import MoEPluginForCausalLM, preset_config

    torch.manual_seed(seed)
    from moe_plugin.models.tokenizer import ByteTokenizer

    MoEPluginForCausalLM(preset_config("tiny", attn_res=False)).save_pretrained(str(path))
    ByteTokenizer().save_pretrained(str(path))  # a base brings its tokenizer (the preset's ids are the byte one's)


def _error(recipe: dict) -> str:
    from moe_plugin.training.loop import Trainer
    from moe_plugin.recipe.schema import recipe_from_dict

    try:
        Trainer(recipe_from_dict(copy.deepcopy(recipe))).close()
    except Exception as err:  # what the case is about: the parent checks the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def _record_loads():
    """Wrap torch.load to record (path, weights_only) of every call; returns (records, restore)."""
    real, seen = torch.load, []

    def spy(f, *args, **kwargs):
        seen.append((os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f), kwargs.get("weights_only")))
        return real(f, *args, **kwargs)

    torch.load = spy
    return seen, lambda: setattr(torch, "load", real)


def zero3_cases(recipe: dict, sentinel_dir: str) -> dict:
    """Train 1 step with a checkpoint; a payload planted in rank 1's optimizer file and in rank 0's model file
    (each in a copy of the run) is refused; then the clean run resumes to step 2 with every torch.load call
    recorded."""
    from moe_plugin.training.loop import train
    from moe_plugin.recipe.schema import recipe_from_dict

    rank, root = dist.get_rank(), recipe["output_dir"]
    train(recipe_from_dict(copy.deepcopy(recipe)))
    engine = os.path.join(root, "checkpoints", "step-00000001", "engine")
    files = sorted(os.listdir(engine))
    planted = {
        "optim1": "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "model0": "engine/zero_pp_rank_0_mp_rank_00_model_states.pt",
    }
    if rank == 0:
        for name, relative in planted.items():
            shutil.copytree(root, f"{root}-{name}")
            plant(
                os.path.join(f"{root}-{name}", "checkpoints", "step-00000001"),
                relative,
                os.path.join(sentinel_dir, name),
            )
    dist.barrier()
    errors = {name: _error({**recipe, "output_dir": f"{root}-{name}"}) for name in planted}
    seen, restore = _record_loads()
    try:
        longer = copy.deepcopy(recipe)
        longer["schedule"]["steps"] = 2
        result = train(recipe_from_dict(longer))
    finally:
        restore()
    return {
        "files": files,
        "errors": errors,
        "planted": planted,
        "loads": seen,
        "losses": result.losses,
        "resumed_from": result.resumed_from,
    }
