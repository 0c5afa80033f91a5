"""The logger interface (moe_plugin/training/metrics/logger.py, wandb_logger.py, load_plot.py): what the console prints,
what an offline W&B run holds (read back from its file), the plot, and the recipe's logging.wandb errors."""

from __future__ import annotations

import io
import os

import pytest

from moe_plugin.training.metrics.load_plot import LoadPlotLogger, plot_expert_load
from moe_plugin.training.metrics.logger import ConsoleLogger, Distribution, Logger, MultiLogger, NullLogger
from moe_plugin.training.metrics.run_logger import make_logger
from moe_plugin.recipe.schema import LoggingSection, RecipeError, recipe_from_dict


def test_console_prints_the_summaries_and_leaves_out_distributions_and_per_layer_keys():
    stream = io.StringIO()
    ConsoleLogger(progress_bar=False, stream=stream).log(
        3,
        {
            "train/loss": 1.25,
            "moe/routing_drift": 0.125,
            "moe/layer1/load_cv": 0.5,
            "moe/layer1/load": Distribution((1.0, 1.0)),
        },
    )
    assert stream.getvalue() == "step     3  loss 1.25  moe/routing_drift 0.125\n"


def test_rank_other_than_zero_logs_nothing_and_a_flag_gives_the_console():
    assert type(make_logger(1, LoggingSection(), "/nonexistent")) is NullLogger
    assert type(make_logger(0, False)) is ConsoleLogger


class _Images(Logger):
    def __init__(self):
        self.images = []

    def image(self, step, name, path):
        self.images.append((step, name, path))


def test_plot_logger_writes_the_png_and_hands_it_on(tmp_path):
    from matplotlib.image import imread

    sink = _Images()
    plot = LoadPlotLogger(str(tmp_path / "expert_load.png"), [sink])
    logger = MultiLogger([plot, sink])
    for step in (1, 2, 5):
        logger.log(
            step,
            {
                "moe/layer1/load": Distribution((0.0, 2.0, 1.0, 1.0)),
                "moe/layer3/load": Distribution((1.0,) * 4),
                "train/loss": 1.0,
            },
        )
    logger.close()
    assert plot.history["layer1"][2] == (5, (0.0, 2.0, 1.0, 1.0))
    assert sink.images == [(5, "moe/expert_load_plot", str(tmp_path / "expert_load.png"))]
    assert imread(sink.images[0][2]).ndim == 3
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]
    with pytest.raises(ValueError, match="history: no expert load was logged"):
        plot_expert_load({}, str(tmp_path / "empty.png"))


def test_plot_draws_the_balance_term_beside_the_load(tmp_path):
    from matplotlib.image import imread

    pictures = []
    for name, with_term in (("plain", False), ("term", True)):
        plot = LoadPlotLogger(str(tmp_path / f"{name}.png"))
        for step in (1, 25, 50):
            metrics = {"moe/layer1/load": Distribution((0.5, 1.5, 1.0, 1.0)), "moe/layer1/load_cv": 0.35}
            if with_term:
                metrics.update({"moe/layer1/aux_loss": 0.1 * step, "moe/aux_loss": 0.1 * step})
            plot.log(step, metrics)
        plot.close()
        pictures.append(imread(plot.written))
        assert plot.aux == ({"layer1": {1: 0.1, 25: 2.5, 50: 5.0}} if with_term else {})
    assert pictures[0].shape == pictures[1].shape and (pictures[0] != pictures[1]).any()


def test_offline_wandb_run_holds_scalars_histograms_and_the_image(tmp_path):
    from moe_plugin.training.metrics.wandb_logger import WandbLogger
    from tests.training.wandb_records import offline_history

    logger = make_logger(
        0,
        LoggingSection(progress_bar=False, wandb={"project": "p", "name": "n"}),
        str(tmp_path / "run"),
        config={"seed": 3},
    )
    (tracker,) = [sink for sink in logger.loggers if isinstance(sink, WandbLogger)]
    logger.log(1, {"train/loss": 2.5, "moe/layer1/load": Distribution(tuple(float(i) for i in range(100)))})
    logger.log(2, {"train/loss": 2.0, "moe/layer1/load": Distribution((1.0,) * 100)})
    logger.close()
    assert tracker.run_dir.startswith(str(tmp_path / "run" / "wandb" / "offline-run-"))
    rows = offline_history(tracker.run_dir)
    assert [row["train/loss"] for row in rows if "train/loss" in row] == [2.5, 2.0], rows
    histogram = rows[0]["moe/layer1/load"]
    assert histogram["_type"] == "histogram" and len(histogram["values"]) == 32 and sum(histogram["values"]) == 100
    assert rows[-1]["moe/expert_load_plot"]["_type"] == "image-file"
    assert os.path.isfile(tmp_path / "run" / "expert_load.png")


def test_wandb_modes_and_their_errors(tmp_path):
    from moe_plugin.training.metrics.wandb_logger import WandbLogger, wandb_logger

    assert type(wandb_logger(LoggingSection(wandb={"mode": "disabled"}).wandb, str(tmp_path))) is NullLogger
    assert not os.path.exists(tmp_path / "wandb")
    with pytest.raises(ValueError, match="wandb mode: expected one of \\['offline', 'online', 'disabled'\\]"):
        wandb_logger(LoggingSection().wandb, str(tmp_path), mode="cloud")
    with pytest.raises(ValueError, match="logging.wandb.mode: a WandbLogger records offline or online"):
        WandbLogger("disabled", "p", None, str(tmp_path))


def _problems(wandb) -> dict:
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict({"output_dir": "o", "model": {"preset": "tiny"}, "logging": {"wandb": wandb}})
    return dict(caught.value.problems)


def test_recipe_wandb_fields_default_to_offline_and_name_their_errors(tmp_path):
    section = recipe_from_dict({"output_dir": "o", "model": {"preset": "tiny"}}).logging.wandb
    assert (section.mode, section.project, section.name, section.dir) == ("offline", "moe_plugin", None, None)
    assert 'must be one of "offline", "online", "disabled"' in _problems({"mode": "cloud"})["logging.wandb.mode"]
    assert "is empty; give the W&B project name" in _problems({"project": ""})["logging.wandb.project"]
    assert 'without "/"' in _problems({"project": "team/p"})["logging.wandb.project"]
    assert "is empty; give the run a name" in _problems({"name": ""})["logging.wandb.name"]
    (tmp_path / "f").write_text("x")
    assert "is a file; give a directory" in _problems({"dir": str(tmp_path / "f")})["logging.wandb.dir"]
    assert "did you mean 'mode'" in _problems({"mod": "online"})["logging.wandb.mod"]
