"""The W&B tracker behind the ``Logger`` interface (docs/hf-trainer.md section 2).

Offline by default: the run is written under ``<dir>/wandb/offline-run-*`` with no network at all (``wandb sync
<that directory>`` uploads it later); ``online`` streams it and needs a W&B login; ``disabled`` gives a
``NullLogger`` without importing wandb. A ``Distribution`` becomes a ``wandb.Histogram`` of ``HISTOGRAM_BINS``
bins, so a layer's expert load is a fixed number of values whatever the number of experts.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from .logger import Distribution, Logger, NullLogger, Value

__all__ = ["WandbLogger", "wandb_logger", "HISTOGRAM_BINS", "MODES"]

HISTOGRAM_BINS = 32
MODES = ("offline", "online", "disabled")


class WandbLogger(Logger):
    """One W&B run: ``mode`` "offline" or "online", files under ``directory`` (``directory/wandb/...``)."""

    def __init__(self, mode: str, project: str, name: Optional[str], directory: str,
                 config: Optional[dict] = None):
        if mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb.mode: a WandbLogger records offline or online, got {mode!r}; use "
                             '"offline" (no network) or "online", or NullLogger for "disabled"')
        import wandb

        os.makedirs(directory, exist_ok=True)
        # no console capture: the trainer's own lines and progress bar stay as they are
        self.run = wandb.init(mode=mode, project=project, name=name, dir=directory, config=config or {},
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                      disable_git=True, save_code=False))
        self._wandb = wandb
        # this run's files (``<directory>/wandb/offline-run-<time>-<id>`` when offline)
        self.run_dir: str = self.run.settings.sync_dir

    def _value(self, value: Value):
        if isinstance(value, Distribution):
            return self._wandb.Histogram([float(v) for v in value.values], num_bins=HISTOGRAM_BINS)
        return float(value)

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        self.run.log({name: self._value(v) for name, v in metrics.items()}, step=step)

    def image(self, step: int, name: str, path: str) -> None:
        self.run.log({name: self._wandb.Image(path)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_logger(section, output_dir: str, config: Optional[dict] = None, mode: Optional[str] = None) -> Logger:
    """The tracker of a recipe's ``logging.wandb`` section (``WandbSection``) for a run writing ``output_dir``;
    ``mode`` overrides the section's. A ``NullLogger`` when the mode is "disabled"."""
    mode = section.mode if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"wandb mode: expected one of {list(MODES)}, got {mode!r}")
    if mode == "disabled":
        return NullLogger()
    name = section.name or os.path.basename(os.path.normpath(output_dir))
    return WandbLogger(mode, section.project, name, section.dir or output_dir, config)
