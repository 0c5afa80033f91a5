"""The DeepSpeed config of a run: the recipe's DeepSpeed JSON (or a default) with the recipe's numbers filled in.

One source of truth: the batch sizes, gradient clipping and precision come from the recipe's ``schedule``. A
DeepSpeed file may leave them out or write ``"auto"``; a different value there is an error naming both places.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from ..recipe.schema import Recipe

# the ZeRO-3 settings of ds_configs/zero3_lora.json. A persistence threshold of 0 keeps small tensors
# partitioned too; above 0, every tensor of a tiny model would stay gathered on every rank.
ZERO3_SETTINGS: Dict[str, Any] = {
    "stage": 3,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "stage3_param_persistence_threshold": 0,
    "stage3_gather_16bit_weights_on_model_save": False,
}
_AUTO = "auto"


def _missing(value: Any) -> bool:
    return value is None or value == _AUTO


def zero_stage(ds_config: Optional[Dict[str, Any]]) -> int:
    """The ZeRO stage a DeepSpeed config dict asks for (0 when it names none): the one reading of it, for the
    trainer, its backends and the planner."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0))


def zero_init(ds_config: dict):
    """``deepspeed.zero.Init`` for a model built partitioned. The dtype comes from the config's bf16 section
    (the recipe's precision): in DeepSpeed 0.19.8 an explicit ``dtype`` argument is dropped on accelerators
    without fp16 (an operator-precedence slip in ``Init._set_dtype``), which made the CPU partitions bf16."""
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=None, pin_memory=False)


def partition_while_building(ds_config: dict, recipe) -> bool:
    """Whether to build the model under ``zero.Init`` (partitioned module by module, so no rank ever holds a
    whole tensor it does not own) rather than whole, for ``deepspeed.initialize`` to partition.

    Under ZeRO-3 with a checkpoint: yes, the loader then writes each rank's slices into its partitions. A
    preset has no checkpoint: its weights are drawn from the seed, and a layer's init code that touches its
    children's weights after they were built (the Hugging Face post-init, our layers' ``reset_parameters``)
    would only see empty placeholders under ``zero.Init``. So a preset is built whole on each rank (the
    dense base and this rank's experts, never another EP rank's), exactly as one process draws it, and the
    engine partitions it; presets are for tests and small models.
    """
    return zero_stage(ds_config) == 3 and recipe.model.from_pretrained is not None


def _same(given: Any, value: Any) -> bool:
    # true == 1 in Python; in a DeepSpeed config a flag and a count are different things
    return isinstance(given, bool) == isinstance(value, bool) and given == value


def _read_file(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(
            f"deepspeed: the DeepSpeed config {path!r} does not exist (relative paths resolve "
            f'against {os.getcwd()}); fix the path, or remove "deepspeed" for the default config'
        )
    try:
        with open(path) as f:
            values = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}, line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); fix the "
            "DeepSpeed config's syntax"
        ) from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a DeepSpeed config must be a JSON object, got {type(values).__name__}")
    return values


def default_config(recipe: Recipe, world_size: int) -> Dict[str, Any]:
    """No ZeRO for one process without expert parallelism, else ZeRO-3 (``ZERO3_SETTINGS``)."""
    single = world_size == 1 and recipe.parallel.expert_parallel_size == 1
    return {
        "zero_optimization": {"stage": 0} if single else copy.deepcopy(ZERO3_SETTINGS),
        "wall_clock_breakdown": False,
    }


def _filled_values(recipe: Recipe, world_size: int) -> List[Tuple[Tuple[str, ...], Any, str]]:
    """(key path in the DeepSpeed config, value, where the recipe says it)."""
    s = recipe.schedule
    return [
        (("train_micro_batch_size_per_gpu",), s.micro_batch_size, f"schedule.micro_batch_size ({s.micro_batch_size})"),
        (
            ("gradient_accumulation_steps",),
            s.gradient_accumulation_steps,
            f"schedule.gradient_accumulation_steps ({s.gradient_accumulation_steps})",
        ),
        # DeepSpeed's data-parallel size is the whole world, also with expert parallelism
        (
            ("train_batch_size",),
            s.micro_batch_size * s.gradient_accumulation_steps * world_size,
            f"schedule.micro_batch_size x schedule.gradient_accumulation_steps x world size ({s.micro_batch_size} x "
            f"{s.gradient_accumulation_steps} x {world_size} = "
            f"{s.micro_batch_size * s.gradient_accumulation_steps * world_size})",
        ),
        (
            ("gradient_clipping",),
            s.clip_grad_norm if s.clip_grad_norm is not None else 0.0,
            f"schedule.clip_grad_norm ({json.dumps(s.clip_grad_norm)})",
        ),
        (("bf16", "enabled"), s.precision == "bf16", f"schedule.precision ({s.precision!r})"),
    ]


def _zero3_reason(recipe: Recipe, world_size: int) -> Optional[str]:
    ep = recipe.parallel.expert_parallel_size
    if ep > 1 and world_size > ep:
        return (
            f"expert parallelism {ep} on {world_size} processes needs each expert partitioned within its "
            "expert-data-parallel group, which only ZeRO-3 does"
        )
    if recipe.parallel.backend == "megatron" and world_size > 1:
        return f"the megatron backend on {world_size} processes trains with ZeRO-3 partitioning"
    return None


def deepspeed_config(recipe: Recipe, world_size: int, base_dir: Optional[str] = None) -> Dict[str, Any]:
    """The merged DeepSpeed config dict for ``deepspeed.initialize``.

    ``recipe.deepspeed`` is read relative to ``base_dir`` when given, else to the current directory; ``None``
    takes ``default_config``. Raises ValueError naming the recipe field and the file's key when they disagree,
    for an ``optimizer``/``scheduler`` section (the trainer passes a torch AdamW and its own schedule, and
    DeepSpeed's CPU fused Adam would JIT-build), for fp16, and for a ZeRO stage the layout cannot train with.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world size (WORLD_SIZE): must be a positive integer, got {world_size!r}")
    if recipe.deepspeed is None:
        where, config = "the default DeepSpeed config", default_config(recipe, world_size)
    else:
        path = recipe.deepspeed
        if base_dir is not None and not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        where, config = recipe.deepspeed, _read_file(path)
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ValueError(
                f"{where}: {section}: the trainer passes its own torch AdamW and learning-rate "
                f"schedule (recipe section schedule); remove the {section!r} section"
            )
    fp16 = config.get("fp16")
    if isinstance(fp16, dict) and not _missing(fp16.get("enabled")) and fp16.get("enabled"):
        raise ValueError(
            f"{where}: fp16.enabled: fp16 needs loss scaling, which this trainer does not do; "
            'remove the fp16 section and set schedule.precision to "bf16" or "fp32"'
        )
    if "bfloat16" in config:
        raise ValueError(
            f'{where}: bfloat16: write DeepSpeed\'s current name "bf16" (or leave it out: schedule.precision fills it)'
        )
    for keys, value, recipe_field in _filled_values(recipe, world_size):
        parent = config
        for key in keys[:-1]:
            if not isinstance(parent.get(key, {}), dict):
                raise ValueError(f"{where}: {key}: must be a JSON object, got {parent[key]!r}")
            parent = parent.setdefault(key, {})
        given = parent.get(keys[-1])
        if not _missing(given) and not _same(given, value):
            raise ValueError(
                f"{recipe_field} and {where}: {'.'.join(keys)} ({json.dumps(given)}) disagree; remove "
                "it from the DeepSpeed config (the recipe fills it) or make them equal"
            )
        parent[keys[-1]] = value
    config.setdefault("fp16", {})["enabled"] = False
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"{where}: zero_optimization: must be a JSON object, got {zero!r}")
    stage = zero.get("stage", 0)
    reason = _zero3_reason(recipe, world_size)
    if reason is not None and stage != 3:
        raise ValueError(
            f"{where}: zero_optimization.stage is {json.dumps(stage)}, but {reason}; set "
            '"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}'
        )
    return config
