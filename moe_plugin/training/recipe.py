"""The recipe: one JSON file that says which model, which adapters, which data and how to train.

Every section is a dataclass validated when it is built; unknown keys are errors that name the key and
list the allowed ones, so a typo in a recipe never silently falls back to a default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..config import require


@dataclass
class ModelSection:
    preset: str = "tiny"
    overrides: Dict[str, Any] = field(default_factory=dict)
    from_pretrained: Optional[str] = None  # a directory written by save_pretrained (or a K3-format checkpoint)


@dataclass
class LoraSection:
    r: int = 8
    alpha: int = 16
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "gate"])
    target_parameters: List[str] = field(default_factory=list)  # e.g. ["experts.w1"]: one adapter per expert

    def __post_init__(self):
        require(self.r > 0, "lora.r", f"must be a positive integer, got {self.r}")
        require(bool(self.target_modules or self.target_parameters), "lora.target_modules",
                "name at least one module (or lora.target_parameters) to adapt")


@dataclass
class DataSection:
    kind: str = "arithmetic"  # "arithmetic" (generated, no files) or "jsonl" (one {"text": ...} per line)
    operation: str = "+"  # arithmetic only: "+", "-" or "*"
    path: Optional[str] = None
    num_documents: int = 2000
    seq_len: int = 256

    def __post_init__(self):
        require(self.kind in ("arithmetic", "jsonl"), "data.kind",
                f"must be 'arithmetic' or 'jsonl', got {self.kind!r}")
        require(self.kind != "jsonl" or bool(self.path), "data.path", "is required when data.kind is 'jsonl'")
        require(self.operation in ("+", "-", "*"), "data.operation",
                f"must be '+', '-' or '*', got {self.operation!r}")
        require(self.seq_len > 1, "data.seq_len", f"must be > 1, got {self.seq_len}")


@dataclass
class TrainSection:
    steps: int = 60
    micro_batch_size: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 10
    output_dir: str = "outputs/tiny_lora"

    def __post_init__(self):
        require(self.steps > 0, "train.steps", f"must be a positive integer, got {self.steps}")
        require(self.micro_batch_size > 0, "train.micro_batch_size",
                f"must be a positive integer, got {self.micro_batch_size}")
        require(self.lr > 0, "train.lr", f"must be positive, got {self.lr}")


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    lora: Optional[LoraSection] = field(default_factory=LoraSection)  # None: train every parameter
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _section(cls, name: str, values: Any):
    require(isinstance(values, dict), name, f"must be a JSON object, got {type(values).__name__}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - allowed)
    require(not unknown, f"{name}.{unknown[0]}" if unknown else name,
            f"unknown key; allowed keys are {sorted(allowed)}")
    return cls(**values)


def recipe_from_dict(values: Dict[str, Any]) -> Recipe:
    sections = {"model": ModelSection, "lora": LoraSection, "data": DataSection, "train": TrainSection}
    unknown = sorted(set(values) - set(sections))
    require(not unknown, unknown[0] if unknown else "recipe", f"unknown section; allowed are {sorted(sections)}")
    built = {name: _section(cls, name, values.get(name, {})) for name, cls in sections.items()
             if not (name == "lora" and "lora" in values and values["lora"] is None)}
    if "lora" not in built:
        built["lora"] = None  # "lora": null asks for full-parameter training
    return Recipe(**built)


def load_recipe(path: str) -> Recipe:
    text = Path(path).read_text()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"recipe {path}: not valid JSON ({err})") from None
    return recipe_from_dict(values)
