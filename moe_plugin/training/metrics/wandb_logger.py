"""The W&B tracker behind the ``Logger`` interface (docs/hf-trainer.md section 2).

Offline by default: the run is written under ``<dir>/wandb/offline-run-*`` with no network at all (``wandb sync
<that directory>`` uploads it later); ``online`` streams it and needs a W&B login; ``disabled`` gives a
``NullLogger`` without importing wandb. Closing the run prints one line: where it is and, offline, the
``wandb sync`` command that uploads it (``sync_line``). A ``Distribution`` becomes a ``wandb.Histogram`` of
``HISTOGRAM_BINS`` bins, so a layer's expert load is a fixed number of values whatever the number of experts.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional

from .logger import Distribution, Logger, NullLogger, Value

__all__ = ["WandbLogger", "wandb_logger", "sync_line", "HISTOGRAM_BINS", "MODES"]

HISTOGRAM_BINS = 32
MODES = ("offline", "online", "disabled")


def sync_line(mode: str, run_dir: str, url: Optional[str] = None) -> str:
    """The line a closed run prints: its directory and, offline, the command that uploads it."""
    if mode == "offline":
        return f"W&B run (offline): {run_dir}; upload it with: wandb sync {run_dir}"
    return f"W&B run (online): {url or run_dir}"


class WandbLogger(Logger):
    """One W&B run: ``mode`` "offline" or "online", files under ``directory`` (``directory/wandb/...``)."""

    def __init__(
        self, mode: str, project: str, name: Optional[str], directory: str, config: Optional[dict] = None, stream=None
    ):
        if mode not in ("offline", "online"):
            raise ValueError(
                f"logging.wandb.mode: a WandbLogger records offline or online, got {mode!r}; use "
                '"offline" (no network) or "online", or NullLogger for "disabled"'
            )
        import wandb

        os.makedirs(directory, exist_ok=True)
        # no console capture: the trainer's own lines and progress bar stay as they are
        self.run = wandb.init(
            mode=mode,
            project=project,
            name=name,
            dir=directory,
            config=config or {},
            settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
            ),
        )
        self._wandb, self.mode, self.stream = wandb, mode, stream
        self.url: Optional[str] = self.run.url if mode == "online" else None
        # this run's files (``<directory>/wandb/offline-run-<time>-<id>`` when offline)
        self.run_dir: str = self.run.settings.sync_dir

    def _value(self, value: Value):
        if isinstance(value, Distribution):
            return self._wandb.Histogram([float(v) for v in value.values], num_bins=HISTOGRAM_BINS)
        return float(value)

    # A step's row is kept here and committed (``commit=True``) once a later step arrives or the run closes.
    # Rows left to W&B's own partial-history flush at exit were lost on a loaded machine (the last row of a
    # run went missing), and a row committed early could take no later value of its step (the eval loss and
    # the plot come after the step's training metrics).
    _pending: Optional[dict] = None
    _pending_step: int = 0

    def _add(self, step: int, values: dict) -> None:
        if self._pending is not None and step > self._pending_step:
            self._flush()
        if self._pending is None:
            self._pending, self._pending_step = {}, step
        self._pending.update(values)

    def _flush(self) -> None:
        if self._pending:
            self.run.log(self._pending, step=self._pending_step, commit=True)
        self._pending = None

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        self._add(step, {name: self._value(v) for name, v in metrics.items()})

    def image(self, step: int, name: str, path: str) -> None:
        self._add(step, {name: self._wandb.Image(path)})

    def close(self) -> None:
        if self.run is not None:
            self._flush()
            self.run.finish()
            self.run = None
            # finish() returns before W&B's service has written the run's last records (on a loaded machine
            # the file then ended before the last row); teardown waits for the service to write and stop
            self._wandb.teardown()
            print(sync_line(self.mode, self.run_dir, self.url), file=self.stream or sys.stdout, flush=True)


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
