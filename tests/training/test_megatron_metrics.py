"""The megatron backend's training log (moe_plugin/training/metrics/moe.py, backends/megatron.py): the DSA
indexer's KL, which the backend's loss reports, is logged as ``moe/indexer_kl`` (once, on the Hugging Face
backend too), and the "model:" line counts the whole model, every expert-parallel rank's experts included, as
the same recipe on the ``hf`` backend in one process does."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from moe_plugin.testing.launch import run_distributed
from moe_plugin.training.metrics.moe import MoEMetrics, global_parameter_counts
from tests.recipes import recipe, whole

WORKER = "tests/training/megatron_metrics_workers.py:run"
STEPS = 2


def _recipe(output_dir, backend: str, world: int, ep: int) -> dict:
    return recipe(
        output_dir,
        world=world,
        ep=ep,
        batch=2,
        seed=4,
        model=whole({"preset": "tiny", "overrides": {"index_topk": 8, "indexer_loss_coeff": 0.5}}),
        # the indexer's projections carry adapters, so it trains and its KL enters the loss
        lora={
            "target_modules": ["q_proj", "k_proj", "gate", "wq_b", "wk", "weights_proj"],
            "target_parameters": ["experts.w1"],
        },
        data={"operation": "+", "num_documents": 60, "seq_len": 48},
        parallel={"backend": backend},
        schedule={"steps": STEPS, "lr": 1e-3},
        logging={"wandb": {"mode": "disabled"}},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_metrics")
    (hf,) = run_distributed(WORKER, world_size=1, timeout_s=900, recipe=_recipe(tmp / "hf", "hf", 1, 1))
    megatron = run_distributed(WORKER, world_size=2, timeout_s=900, recipe=_recipe(tmp / "mg", "megatron", 2, 2))
    return hf, megatron


def _counts(line: str):
    total, trainable = re.search(r"\): ([0-9,]+) parameters, ([0-9,]+) trainable", line).groups()
    return int(total.replace(",", "")), int(trainable.replace(",", ""))


@pytest.mark.distributed
def test_megatron_logs_the_indexer_kl_of_its_loss(runs):
    _, ranks = runs
    for rank in ranks:
        assert len(rank["kls"]) == STEPS and all(kl is not None and kl > 0 for kl in rank["kls"]), (
            "premise: the indexer's KL is in every training loss"
        )
    for step in range(1, STEPS + 1):
        # one micro-batch a rank a step: the logged value is the mean over both ranks' micro-batches
        expected = sum(rank["kls"][step - 1] for rank in ranks) / len(ranks)
        for rank in ranks:
            assert rank["logged"][step]["moe/indexer_kl"] == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.distributed
def test_hf_backend_logs_its_indexer_kl_once(runs):
    hf, _ = runs
    assert len(hf["kls"]) == STEPS
    for step in range(1, STEPS + 1):
        assert hf["logged"][step]["moe/indexer_kl"] == pytest.approx(hf["kls"][step - 1], rel=1e-12, abs=0)


@pytest.mark.distributed
def test_model_line_counts_every_experts_rank_and_the_processes(runs):
    hf, ranks = runs
    assert "(hf backend, 1 process, expert parallel 1," in hf["describe"]
    for rank in ranks:
        assert "(megatron backend, 2 processes, expert parallel 2, ZeRO stage 3)" in rank["describe"]
        assert _counts(rank["describe"]) == _counts(hf["describe"])


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(2, 3, 5))  # this rank's 2 experts
        self.w1.allreduce = False  # megatron's expert mark
        self.dense = nn.Linear(4, 4)  # 20 elements
        self.dense.weight.requires_grad_(False)


def test_global_counts_scale_the_expert_parameters_only():
    model = _Experts()
    assert global_parameter_counts(model, 1) == (30 + 4, 30 + 20)
    assert global_parameter_counts(model, 4) == (4 * 30 + 4, 4 * 30 + 20)


def test_loss_metrics_count_for_a_model_without_an_indexer_hook():
    metrics = MoEMetrics(_Experts())  # megatron's face: no model output carries indexer_loss
    metrics.add_loss_metrics({"indexer_kl": torch.tensor(0.25)})
    metrics.add_loss_metrics({"indexer_kl": torch.tensor(0.75)})
    metrics.add_loss_metrics({})
    assert metrics.collect(None) == {"moe/indexer_kl": 0.5}
    assert metrics.collect(None) == {}  # each collect covers the forwards since the last
