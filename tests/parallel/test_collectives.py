"""DeepSpeed's ZeRO-3 and megatron-core's token dispatcher call torch's current ``reduce_scatter_single`` /
``all_gather_single`` (moe_plugin/compat/deepspeed.py, moe_plugin/compat/megatron.py): the same
results, and none of the deprecation warnings that their old aliases print (they broke the progress bar)."""

import pytest
import torch

from moe_plugin.testing.launch import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts processes


def test_collectives_give_the_same_results_without_deprecation_warnings():
    ranks = run_distributed("tests/parallel/collectives_workers.py:run", world_size=2, timeout_s=600)
    # rank r contributes arange(4) + r: the sums are 2 * arange(4) + 1, rank r keeps its half
    total = 2 * torch.arange(4.0) + 1
    for rank, got in enumerate(ranks):
        assert torch.equal(got["scattered"], total[2 * rank : 2 * rank + 2])
        assert torch.equal(got["gathered"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert torch.equal(got["megatron_gathered"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert got["warnings"] == [], got["warnings"]
        assert got["megatron_aliases"] == ["all_gather_single", "reduce_scatter_single"]
