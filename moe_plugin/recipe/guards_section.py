"""The recipe's ``guards`` section: when a run stops itself (the rules: ``moe_plugin.training.guards``)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DivergenceSection", "GuardsSection"]


class DivergenceSection(BaseModel):
    """The divergence rule: diverging when mean(last ``window`` losses) > ``factor`` x the first step's loss;
    stop once more than ``stop_after`` steps in a row diverge (null: warn only)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    factor: float = Field(1.5, gt=1, description="use a factor above 1, e.g. 1.5")
    window: int = Field(5, gt=0, description="use a positive number of steps, e.g. 5")
    stop_after: Optional[int] = Field(10, ge=0, description="use 0 or more steps, or null to only warn")


class GuardsSection(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    divergence: DivergenceSection = Field(default_factory=DivergenceSection)
