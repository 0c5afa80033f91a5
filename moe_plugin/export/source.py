"""What an export reads from a run directory: the recipe, the base checkpoint, the LoRA config and the adapter.

A run directory (``moe_plugin.training``) holds ``moe_plugin_run.json`` (the recipe), ``moe_plugin_inputs.json``
(what the run read: the base's absolute path and fingerprint, ``training/inputs.py``), ``adapter/`` (the final
adapter in PEFT format, already gathered across expert-parallel and ZeRO ranks), ``checkpoints/step-*/``
(DeepSpeed engine checkpoints of the adapters) and, for a preset base, ``base/`` (the base weights drawn from
the seed). ``--step N`` reads the adapter of checkpoint N instead of the final one (``zero_checkpoint``).

The base is the one the run recorded, never the recipe's relative path resolved against today's working
directory (docs/exports.md "Which base"). Every damaged file is named in a one-line ValueError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ..config import require
from ..fileio import read_json
from ..training.run_dir import MARKER
from .targets import Target, adapter_targets, check_state_covers, is_image_adapter, onto_image_model

__all__ = ["RunSource", "RunLocation", "locate_run", "open_run", "OVERRIDE_FLAG"]

OVERRIDE_FLAG = "--allow-changed-inputs"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class RunLocation:
    """Where a run's inputs are, found without loading any tensor. run_dir and base_path are real paths
    (symlinks resolved); base_path is the base the run trained on (``run_dir/base`` for a preset)."""

    run_dir: str
    recipe: dict
    base_path: str


@dataclass
class RunSource:
    """One run's export inputs. state: the adapter tensors under PEFT keys (``base_model.model.<name>.lora_A
    .weight``, stacked expert adapters over all E); targets: every tensor the run's LoRA config adapts;
    base_path: the base checkpoint directory (Hugging Face or K3 layout); hf_config: the base model's
    ``MoEPluginConfig`` (recipe overrides applied); lora_config: peft's ``LoraConfig`` of the run."""

    run_dir: str
    step: Optional[int]
    recipe: dict
    base_path: str
    hf_config: object
    lora_config: object
    state: Dict[str, torch.Tensor]
    targets: Dict[str, Target]

    @property
    def model_config(self):
        return self.hf_config.to_model_config()


def _read_json_object(path: str, fix: str) -> Dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file (and line) when it is not one."""
    value = read_json(path, fix)
    require(isinstance(value, dict), path, f"holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


def _read_recipe(run_dir: str) -> dict:
    marker = os.path.join(run_dir, MARKER)
    require(
        os.path.isfile(marker),
        "run",
        f"{run_dir} has no {MARKER}: it is not a run directory of this project "
        "(give the output_dir a training run wrote)",
    )
    recipe = _read_json_object(marker, "it is the run's recipe: restore it from the recipe the run was started with")
    require(
        isinstance(recipe.get("model"), dict),
        marker,
        'has no "model" object: it is not a recipe this '
        "project wrote; restore it from the recipe the run was started with",
    )
    return recipe


def _recorded_inputs(run_dir: str) -> Optional[dict]:
    try:
        from ..training.inputs import read_recorded_inputs
    except ImportError:  # a checkout without input records: every run is one from before they existed
        return None
    return read_recorded_inputs(run_dir)


def _adapter_base(run_dir: str) -> Optional[str]:
    """The absolute base path the run wrote into its final adapter's config, if it finished."""
    path = os.path.join(run_dir, "adapter", ADAPTER_CONFIG)
    if not os.path.isfile(path):
        return None
    written = _read_json_object(path, "it is written at the end of training: restore it, or pass --step N")
    base = written.get("base_model_name_or_path")
    return base if isinstance(base, str) and os.path.isabs(base) else None


def _recorded_base(run_dir: str, given: str, recorded: Optional[dict], allow_changed_inputs: bool) -> str:
    """The base a from_pretrained run read: the record's path, else the recipe's path if absolute, else the
    path its final adapter names; a relative path no record pins is resolved only when the user says so."""
    if recorded is not None and isinstance(recorded["base"].get("path"), str):
        return recorded["base"]["path"]
    if os.path.isabs(os.path.expanduser(given)):
        return os.path.expanduser(given)
    from_adapter = _adapter_base(run_dir)
    if from_adapter is not None:
        return from_adapter
    require(
        allow_changed_inputs,
        "run",
        f"model.from_pretrained is the relative path {given!r} and the run recorded "
        f"no absolute base (no moe_plugin_inputs.json, no final adapter naming it), so it cannot tell which "
        f"base it trained on; run the export from the directory the training ran in and pass {OVERRIDE_FLAG} "
        f"to resolve it against the current directory ({os.getcwd()})",
    )
    return os.path.abspath(given)


def _check_base_unchanged(recipe: dict, base_path: Optional[str], recorded: Optional[dict]) -> None:
    """ValueError naming the base if it differs from the run's record (data files are not an export's input)."""
    if recorded is None:
        return
    from ..training.inputs import check_inputs, fingerprint_inputs

    current = fingerprint_inputs({"model": recipe["model"]}, base_path)
    check_inputs(
        {"base": recorded["base"], "data": {}}, {"base": current["base"], "data": {}}, override_flag=OVERRIDE_FLAG
    )


def locate_run(run_dir: str, allow_changed_inputs: bool = False) -> RunLocation:
    """Read the run's recipe and find its base (cheap: no tensor is loaded). Refuses, naming the file, a corrupt
    marker or input record, and a base that changed since the run recorded it unless ``allow_changed_inputs``."""
    require(
        isinstance(run_dir, str) and run_dir.strip() != "",
        "run",
        f"is empty ({run_dir!r}); give the output_dir of a training run",
    )
    run_dir = os.path.realpath(os.path.expanduser(run_dir))
    recipe = _read_recipe(run_dir)
    require(
        recipe.get("lora") is not None,
        "run",
        f'{run_dir} trained every parameter ("lora": null): its '
        "output_dir/model is already the full model, there is no adapter to export",
    )
    recorded = _recorded_inputs(run_dir)
    given = recipe["model"].get("from_pretrained")
    if given is None:  # a preset: the run wrote the base it drew beside its adapter
        base_path = os.path.join(run_dir, "base")
        require(
            os.path.isdir(base_path),
            "run",
            f"the base checkpoint {base_path} is missing (a preset run writes it "
            "at the end of training: did the run finish?)",
        )
    else:
        require(
            isinstance(given, str) and given.strip() != "",
            os.path.join(run_dir, MARKER),
            f"model.from_pretrained is {given!r}, not a path; restore the recipe the run was started with",
        )
        base_path = os.path.realpath(_recorded_base(run_dir, given, recorded, allow_changed_inputs))
        require(
            os.path.isdir(base_path),
            "run",
            f"the base checkpoint {base_path} the run trained on is missing; restore it there",
        )
    if not allow_changed_inputs:
        _check_base_unchanged(recipe, base_path if given is not None else None, recorded)
    return RunLocation(run_dir, recipe, base_path)


def _lora_config(adapter: str):
    from peft import LoraConfig

    path = os.path.join(adapter, ADAPTER_CONFIG)
    require(
        os.path.isfile(path),
        "run",
        f"{adapter} has no {ADAPTER_CONFIG} (did the run finish? pass --step N to export a checkpoint)",
    )
    values = _read_json_object(path, "it is written at the end of training: restore it, or pass --step N")
    try:
        return LoraConfig.from_pretrained(adapter)
    except (TypeError, ValueError, KeyError) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(
            f"{path}: not a PEFT LoRA config ({type(err).__name__}: {why}; peft_type "
            f"{values.get('peft_type')!r}); restore it, or pass --step N"
        ) from None


def _adapter_state(adapter: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..fileio import read_safetensors_header

    path = os.path.join(adapter, ADAPTER_WEIGHTS)
    require(
        os.path.isfile(path),
        "run",
        f"{adapter} has no {ADAPTER_WEIGHTS} (did the run finish? pass --step N to export a checkpoint)",
    )
    try:
        read_safetensors_header(path)  # names a truncated file or a bad header before safetensors reads it
        return load_file(path)
    except ValueError as err:
        raise ValueError(
            str(err)
            .removeprefix("path: ")
            .replace("re-download or re-save it", "restore it, or pass --step N to export a checkpoint")
        ) from None
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path}: damaged safetensors file ({err}); restore it, or pass --step N to export a checkpoint"
        ) from None


def open_run(
    run_dir: str, step: Optional[int] = None, allow_changed_inputs: bool = False, location: Optional[RunLocation] = None
) -> RunSource:
    """Read the run at ``run_dir`` (its final adapter, or checkpoint ``step``); ValueError naming what is wrong.
    location: what ``locate_run`` found already (it is not looked up again)."""
    from ..recipe.schema import LoraSection, ModelSection, ParallelSection
    from ..recipe.resolved_model import base_hf_config
    from .merge import has_vision

    where_run = location or locate_run(run_dir, allow_changed_inputs)
    recipe, base_path = where_run.recipe, where_run.base_path
    model_values = dict(recipe["model"])
    if model_values.get("from_pretrained") is not None:
        model_values["from_pretrained"] = base_path  # the recorded base, whatever the working directory
    model = ModelSection.model_validate(model_values)
    lora = LoraSection.model_validate(recipe["lora"])
    backend = ParallelSection.model_validate(recipe.get("parallel", {})).backend
    config = base_hf_config(model)  # the trainer's one reading of a base's config (recipe/resolved_model.py)
    trained = lora.peft_config()
    targets = adapter_targets(config, trained)
    if step is None:
        adapter = os.path.join(where_run.run_dir, "adapter")
        written = _lora_config(adapter)
        listed = adapter_targets(config, written)
        uncovered = sorted(n for n, t in targets.items() if listed.get(n) != t)
        require(
            not uncovered,
            f"{adapter}/{ADAPTER_CONFIG}",
            f"its target list does not cover what was "
            f"trained: {len(uncovered)} trained target(s) are not adapted (or not scaled) as in the run's recipe, "
            f"e.g. {uncovered[:10]}; a loader following this config would drop their deltas (rewrite it from "
            "the recipe's lora section)",
        )
        state = _adapter_state(adapter)
        where = f"{adapter}/{ADAPTER_WEIGHTS}"
    else:
        from .zero_checkpoint import adapter_from_checkpoint

        state = adapter_from_checkpoint(
            where_run.run_dir, step, config.to_model_config(), backend, lora.r, vision=has_vision(base_path)
        )
        where = f"checkpoint step {step}"
    if is_image_adapter(state):  # an image run's adapter: its targets are the image model's (language_model.)
        targets = adapter_targets(config, trained, image=True)
    elif has_vision(base_path):  # a text run over an image base: the base loads as the image model, so the
        # adapter goes onto that model's language model, and the vision tower is the base's, unchanged
        state, targets, trained = onto_image_model(state, config, trained)
    check_state_covers(targets, state, where)
    return RunSource(where_run.run_dir, step, recipe, base_path, config, trained, state, targets)
