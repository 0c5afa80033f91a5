"""parallel.layout.ParallelLayout: sizes checked when built (naming the field), groups started and checked
against megatron's and DeepSpeed's, and the one expert-tag rule."""

import pytest
from torch import nn

from moe_plugin.parallel.layout import ParallelLayout
from moe_plugin.testing.launch import run_distributed

WORKERS = "tests/parallel/distributed_workers.py"


def test_sizes_are_derived_and_checked_when_built():
    layout = ParallelLayout(world=8, expert=4)
    assert (layout.data, layout.expert_data, layout.tensor) == (8, 2, 1)
    assert ParallelLayout(world=8, expert=2, tensor=2).expert_data == 2
    with pytest.raises(
        ValueError,
        match=r"^parallel\.expert_parallel_size: expert x tensor parallel size \(3 x 1\) "
        r"must divide the world size 4; launch a multiple of 3 processes",
    ):
        ParallelLayout(world=4, expert=3)
    with pytest.raises(ValueError, match=r"^world size \(WORLD_SIZE\): must be a positive integer, got 0"):
        ParallelLayout(world=0)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: must be a positive integer, got True"):
        ParallelLayout(world=2, expert=True)


def test_from_recipe_reads_the_parallel_section():
    from moe_plugin.recipe.schema import ParallelSection

    assert ParallelLayout.from_recipe(ParallelSection(expert_parallel_size=2), world=4) == ParallelLayout(4, 2)


def test_an_unstarted_layout_removes_the_expert_marks_and_refuses_expert_parallelism():
    module = nn.Linear(2, 2)
    module.weight.allreduce = False
    assert ParallelLayout(world=1).tag_expert_parameters(module, zero3=True) == 0
    assert not hasattr(module.weight, "allreduce")
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: is 2, which needs ZeRO-3"):
        ParallelLayout(world=2, expert=2).tag_expert_parameters(module, zero3=False)


@pytest.mark.distributed
def test_start_gives_the_ranks_groups_and_tags_of_the_layout():
    results = run_distributed(f"{WORKERS}:start_layout", world_size=2, timeout_s=300, init_process_group=False)
    for rank, r in enumerate(results):
        assert (r["dp_rank"], r["ep_rank"], r["data"], r["expert_data"]) == (rank, rank, 2, 1)
        assert r["started_is_it"] and r["stopped"]
        assert r["mismatch"] == (
            "megatron's expert-parallel size is 2, the layout's 1: megatron-core's parallel "
            "state was started for another layout"
        )
        # an expert parameter is partitioned within its expert-data-parallel group: at EP 2 on 2 ranks, itself
        assert r["tagged"] == 1 and r["tag_group"] == [rank] and not r["plain_tagged"]
