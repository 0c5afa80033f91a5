"""The recipe's ``model`` section: which base (a preset or a model directory), its config overrides, and
whether its remote code may run. Reading it loads neither torch nor transformers; its second-pass checks
build the model's config (``recipe/schema.py``)."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from typing import Any, Dict, List, Literal, Optional

from ..config import HF_MODEL_TYPE, ModelConfig
from ..fileio import read_json
from .section import Problem, _field, _Section


def _read_json(path: str) -> Dict[str, Any]:
    values = read_json(path, "give a directory whose config.json is a JSON object")
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(values).__name__}")
    return values


@functools.lru_cache(maxsize=None)
def _override_keys() -> frozenset:
    from transformers import PretrainedConfig

    from ..models.configuration import MoEPluginConfig

    # from_pretrained drops a keyword the config does not have without a word, so unknown keys are refused here
    params = set(inspect.signature(MoEPluginConfig.__init__).parameters)
    params |= set(inspect.signature(PretrainedConfig.__init__).parameters)
    return frozenset(params - {"self", "kwargs"}) | {"bos_token_id", "eos_token_id", "pad_token_id"}


def _pretrained_problem(directory: str) -> Optional[str]:
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        return (
            f"{directory!r} {what} (relative paths resolve against {os.getcwd()}); "
            "give the directory that save_pretrained wrote (or a K3 checkpoint directory)"
        )
    adapter = os.path.join(directory, "adapter_config.json")
    if os.path.exists(adapter):
        try:
            base = _read_json(adapter).get("base_model_name_or_path")
        except ValueError:
            base = None
        return (
            f"{directory!r} holds a LoRA adapter (adapter_config.json), not a base model; point "
            f"model.from_pretrained at its base model ({base!r}, the adapter's base_model_name_or_path)"
        )
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return (
            f"{directory!r} has no config.json, so it is not a saved model; give the directory that "
            "save_pretrained wrote (or a K3 checkpoint directory)"
        )
    try:
        _read_json(os.path.join(directory, "config.json"))
    except ValueError as err:
        return f"{err}; repair or replace the model's config.json"
    return None


class _ConfigAndBuilder(dict):
    """pydantic reserves the class attribute ``model_config`` for its settings, while the trainer calls
    ``section.model_config()``. Read on the class, this is the settings dict pydantic uses; read on an instance
    it is the same dict bound to that section, and calling it builds the section's ``ModelConfig``."""

    _section: Optional["ModelSection"] = None

    def __get__(self, section, owner=None):
        if section is None:
            return self
        bound = _ConfigAndBuilder(self)
        bound._section = section
        return bound

    def __call__(self) -> ModelConfig:
        return self._section.build_model_config()


class ModelSection(_Section):
    """Exactly one of ``preset`` (a name in ``PRESETS``) and ``from_pretrained`` (a model directory)."""

    preset: Optional[str] = _field(None, example="tiny")
    from_pretrained: Optional[str] = _field(None, example="recipes/bases/tiny-arith")
    overrides: Dict[str, Any] = _field(default_factory=dict, example={"num_experts": 8})
    # run the code a base's tokenizer or config maps to in its directory (auto_map), as transformers does
    trust_remote_code: bool = False
    # train an image+text base as its text model: its vision_config is not read (a tower this project does not
    # build is then no obstacle) and its vision tensors are not loaded (docs/multimodal.md 7)
    ignore_vision: bool = False

    def source_format(self) -> Literal["preset", "hf", "k3"]:
        """ "preset", "hf" (a ``save_pretrained`` directory) or "k3" (a K3-layout checkpoint)."""
        if self.preset is not None:
            return "preset"
        model_type = _read_json(os.path.join(self.from_pretrained, "config.json")).get("model_type")
        return "hf" if model_type == HF_MODEL_TYPE else "k3"

    def build_model_config(self) -> ModelConfig:
        """The validated model dataclasses, from the config alone (no weights or tokenizer are read)."""
        from .resolved_model import base_hf_config

        return base_hf_config(self).to_model_config()

    def _problems(self) -> List[Problem]:
        if (self.preset is None) == (self.from_pretrained is None):
            what = (
                "both model.preset and model.from_pretrained are given"
                if self.preset is not None
                else "neither model.preset nor model.from_pretrained is given"
            )
            return [
                (
                    "",
                    f'{what}; give exactly one, e.g. {{"preset": "tiny"}} or '
                    f'{{"from_pretrained": "recipes/bases/tiny-arith"}}',
                )
            ]
        if self.from_pretrained is not None:
            problem = _pretrained_problem(self.from_pretrained)
            if problem:
                return [("from_pretrained", problem)]
        return []

    def _model_config_problems(self) -> List[Problem]:
        from ..models.presets import PRESETS

        problems: List[Problem] = []
        if self.preset is not None and self.preset not in PRESETS:
            problems.append(("preset", f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}"))
        for key in sorted(set(self.overrides) - _override_keys()):
            close = difflib.get_close_matches(key, sorted(_override_keys()), 1)
            hint = f"did you mean {close[0]!r}?" if close else "use a key of MoEPluginConfig"
            problems.append((f"overrides.{key}", f"not a model config key; {hint}"))
        if not problems:
            try:
                self.build_model_config()
            except (ValueError, TypeError, KeyError) as err:
                where = "overrides" if self.overrides else ("preset" if self.preset else "from_pretrained")
                problems.append((where, f"the model config is invalid: {err}; fix that value"))
        return problems


ModelSection.model_config = _ConfigAndBuilder(ModelSection.model_config)
