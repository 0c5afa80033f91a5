"""The expert load per layer over training, as one PNG (docs/hf-trainer.md section 2).

``LoadPlotLogger`` is a ``Logger`` that keeps the ``moe/<layer>/load`` distributions (each expert's load share,
load / mean, of a logged step) and, when the run closes, draws one heat map per MoE layer: logged steps
across, experts down, the share as colour (1 is an even share, 0 a dead expert). Beside the load, the layer's
balance term (``moe/<layer>/aux_loss``, the sequence-wise balance loss in the step's loss) is drawn over the
same steps as a line on its own axis, when the run has one. It writes the PNG and hands its path to the other
loggers (``Logger.image``: W&B stores the picture, the console prints the path).
"""

from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from .logger import Distribution, Logger, Value

__all__ = ["LoadPlotLogger", "plot_expert_load", "IMAGE_KEY"]

IMAGE_KEY = "moe/expert_load_plot"
_LOAD_KEY = re.compile(r"^moe/(.+)/load$")
_AUX_KEY = re.compile(r"^moe/(.+)/aux_loss$")


def plot_expert_load(
    history: Dict[str, List[Tuple[int, Sequence[float]]]], path: str, aux: Optional[Dict[str, Dict[int, float]]] = None
) -> str:
    """history ``{layer label: [(step, shares [E]), ...]}`` -> ``path``, a PNG with one heat map per layer;
    aux ``{layer label: {step: balance term}}`` adds each layer's balance term as a line on a right-hand axis
    (at the logged steps it has). Written to a temporary name and renamed, so an interrupted run leaves no
    half-written picture."""
    if not history:
        raise ValueError(
            "history: no expert load was logged, so there is nothing to plot; log moe/<layer>/load distributions first"
        )
    import matplotlib

    matplotlib.use("Agg", force=False)  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt
    import numpy as np

    labels = sorted(history, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])
    cols = min(len(labels), 4)
    rows = math.ceil(len(labels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.0 * cols + 1.0, 3.2 * rows + 0.6), squeeze=False, layout="constrained"
    )
    vmax = max(2.0, max(max(s) for entries in history.values() for _, s in entries))
    image = None
    for ax, label in zip(axes.flat, labels):
        steps = [step for step, _ in history[label]]
        grid = np.array([list(shares) for _, shares in history[label]], dtype=float).T  # [E, logged steps]
        # one column per logged step, labelled with the step (logged steps need not be evenly spaced)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=vmax)
        ticks = sorted(set(np.linspace(0, len(steps) - 1, min(len(steps), 6)).round().astype(int).tolist()))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_title(label)
        ax.set_xlabel("logged step")
        ax.set_ylabel("expert")
        terms = (aux or {}).get(label, {})
        columns = [(i, terms[step]) for i, step in enumerate(steps) if step in terms]
        if columns:
            twin = ax.twinx()  # the balance term beside the load: its own scale, the heat map's columns
            twin.plot([i for i, _ in columns], [v for _, v in columns], color="#4fc3f7", marker=".", linewidth=1.5)
            twin.set_ylabel(f"balance term (moe/{label}/aux_loss)", color="#0277bd")
            twin.set_ylim(0.0, 1.25 * max(v for _, v in columns) or 1.0)
            ax.set_title(f"{label} (balance term {columns[-1][1]:.3g} at step {steps[columns[-1][0]]})")
    for ax in list(axes.flat)[len(labels) :]:
        ax.axis("off")
    fig.suptitle("expert load share per MoE layer (load / mean; 0 = dead)")
    fig.colorbar(image, ax=axes, shrink=0.8, location="left")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial.png"
    fig.savefig(partial, dpi=100)
    plt.close(fig)
    os.replace(partial, path)
    return path


class LoadPlotLogger(Logger):
    """Collects the load distributions of the logged steps; ``close()`` writes ``path`` (when any was logged)
    and passes it to ``forward_to`` through ``Logger.image``."""

    def __init__(self, path: str, forward_to: Sequence[Logger] = ()):
        self.path, self.forward_to = path, list(forward_to)
        self.history: Dict[str, List[Tuple[int, Sequence[float]]]] = {}
        self.aux: Dict[str, Dict[int, float]] = {}
        self.last_step = 0
        self.written = None

    def log(self, step: int, metrics: Dict[str, Value]) -> None:
        for name, value in metrics.items():
            match = _LOAD_KEY.match(name)
            if match and isinstance(value, Distribution):
                self.history.setdefault(match.group(1), []).append((step, tuple(value.values)))
                self.last_step = max(self.last_step, step)
            term = _AUX_KEY.match(name)
            if term and not isinstance(value, Distribution):
                self.aux.setdefault(term.group(1), {})[step] = float(value)

    def close(self) -> None:
        if not self.history or self.written is not None:
            return
        self.written = plot_expert_load(self.history, self.path, self.aux)
        for logger in self.forward_to:
            logger.image(self.last_step, IMAGE_KEY, self.written)
