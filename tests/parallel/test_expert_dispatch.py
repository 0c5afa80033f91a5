"""moe_plugin/megatron/expert_dispatch.py on one process: the chunk-major order of the token copies, the chunks'
bounds, the layout's rule for a rank's experts, and the exposed time the metrics report. The dispatch itself
(bitwise equal in 1, 2 and 4 chunks, the planted bugs) runs in the expert-parallel launches:
tests/megatron/test_megatron_latent_moe.py (EP 2) and tests/training/test_context_parallel_trainer.py (EP 4)."""

import pytest
from torch import nn

from moe_plugin.megatron.expert_dispatch import chunk_bounds, sort_key
from moe_plugin.parallel.layout import ParallelLayout, experts_held


def test_chunk_bounds_split_a_ranks_experts_evenly():
    assert chunk_bounds(4, 1) == [0, 4]
    assert chunk_bounds(4, 4) == [0, 1, 2, 3, 4]
    assert chunk_bounds(7, 3) == [0, 2, 4, 7]
    for bad in (0, 5, True, 2.0):
        with pytest.raises(
            ValueError, match=r"^parallel\.moe_overlap_chunks: must be an integer from 1 to the experts"
        ):
            chunk_bounds(4, bad)


@pytest.mark.parametrize("experts,ep,chunks", [(8, 2, 1), (8, 2, 2), (16, 4, 2), (12, 2, 3), (8, 4, 2)])
def test_sort_key_is_chunk_then_rank_then_expert(experts, ep, chunks):
    """Sorting by the key puts each chunk's copies in one slice, in destination-rank blocks, each in expert order;
    with one chunk it is the expert order itself (so N = 1 is today's exchange)."""
    local = experts // ep
    bounds = chunk_bounds(local, chunks)
    chunk_of = [next(c for c in range(chunks) if bounds[c] <= j < bounds[c + 1]) for j in range(local)]
    by_hand = sorted(range(experts), key=lambda e: (chunk_of[e % local], e // local, e % local))
    key = sort_key(experts, ep, bounds, "cpu")
    assert sorted(key.tolist()) == list(range(experts))
    assert [e for _, e in sorted(zip(key.tolist(), range(experts)))] == by_hand
    if chunks == 1:
        assert key.tolist() == list(range(experts))


def test_the_layout_owns_which_experts_a_rank_holds():
    assert [experts_held(16, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert ParallelLayout(world=4, expert=2).experts_held(8, ep_rank=1) == (4, 8)
    assert ParallelLayout(world=1).experts_held(8) == (0, 8)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: must divide the number of routed experts"):
        experts_held(10, 4, 0)


def test_exposed_time_is_reported_per_step_where_a_dispatch_communicates():
    """MoEMetrics reports moe/a2a_exposed_s, the seconds a rank waited on the all-to-alls per step, from the
    dispatchers that count them; a model whose dispatch stays on the device reports none."""
    from moe_plugin.config import MoEConfig
    from moe_plugin.layers.moe import StableLatentMoE
    from moe_plugin.training.metrics.moe import MoEMetrics

    class Counting:
        waited = 0.0

        def pop_waited(self):
            value, self.waited = self.waited, 0.0
            return value

    model = nn.ModuleDict(
        {
            "layers": nn.ModuleList(
                [StableLatentMoE(MoEConfig(hidden_size=8, num_experts=4, top_k=2, expert_intermediate_size=8))]
            )
        }
    )
    metrics = MoEMetrics(model)
    metrics.add_step(None)
    assert "moe/a2a_exposed_s" not in metrics.collect()
    model["layers"][0].dispatch = Counting()
    model["layers"][0].dispatch.waited = 0.3
    metrics.add_step(None)
    metrics.add_step(None)
    assert metrics.collect()["moe/a2a_exposed_s"] == pytest.approx(0.15)
    assert model["layers"][0].dispatch.waited == 0.0
