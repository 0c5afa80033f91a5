"""The planner: counts from the meta model, clear errors, and the planned per-rank peak against measured runs of
the product's Trainer (1, 2 and 4 processes; EP 1 and 2 with ZeRO-3; dense and MXFP4 experts; several sequence
lengths). The goal is 15 %; the test asserts 25 % so that a busy machine does not make it flaky."""

from __future__ import annotations

import tempfile

import pytest
import torch

from moe_plugin.parallel.launch import run_distributed
from moe_plugin.plan.counts import count_model, rank_share
from moe_plugin.plan.measure import CALIBRATION, LAYOUTS, layout_recipe, planned_peak
from moe_plugin.plan.planner import parse_bytes, plan_recipe
from moe_plugin.training.recipe import LoraSection, recipe_from_dict


def test_counts_come_from_the_model_and_split_by_the_zero3_ep_rule():
    from moe_plugin.models import MoEPluginForCausalLM, preset_config

    cfg = preset_config("tiny", attn_res=False)
    counts = count_model(cfg, LoraSection(), precision_bytes=4)
    real = MoEPluginForCausalLM(cfg)  # an independent count: the real model on the CPU
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    assert counts.kinds["experts"].numel == experts
    assert counts.total_numel - counts.adapter_numel == sum(p.numel() for p in real.parameters())
    # r=8 adapters on the 3 KDA layers' q_proj/k_proj and the router: r x (in + out) each
    kda = [m for n, m in real.named_modules() if n.endswith(("q_proj", "k_proj")) and "self_attn" in n]
    gates = [m for n, m in real.named_modules() if n.endswith("block_sparse_moe.gate")]
    assert counts.adapter_numel == sum(8 * (m.in_features + m.out_features) for m in kda + gates)
    share = rank_share(counts, world=4, ep=2, zero3=True)
    assert share["experts"] == pytest.approx(experts * 4 / 2 / 2)
    assert share["embeddings"] == pytest.approx(counts.kinds["embeddings"].nbytes / 4)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("lots")
    recipe = recipe_from_dict(layout_recipe("/tmp/never", 4, 2, 256, shape=CALIBRATION))
    with pytest.raises(ValueError, match="--devices.*multiple of parallel.expert_parallel_size"):
        plan_recipe(recipe, devices=3)


def _check(world: int) -> None:
    cache: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        recipes = [layout_recipe(f"{tmp}/calibration", world, 1, 256, shape=CALIBRATION)] + [
            layout_recipe(f"{tmp}/l{i}", *layout) for i, layout in enumerate(LAYOUTS[world])]
        planned = [planned_peak(r, world, cache) for r in recipes]
        measured = run_distributed("moe_plugin.plan.measure:measure_worker", world_size=world, timeout_s=3000,
                                   recipes=recipes, threads=max(1, 2 // world))
    for rank in range(world):
        peaks = [m["peak_bytes"] for m in measured[rank]]
        overhead = peaks[0] - planned[0]  # the calibration layout: the framework's own memory
        for layout, plan, peak in zip(LAYOUTS[world], planned[1:], peaks[1:]):
            error = (plan + overhead - peak) / peak
            assert abs(error) < 0.25, (f"rank {rank}, layout {layout}: planned {(plan + overhead) / 2**20:.0f} MiB, "
                                       f"measured {peak / 2**20:.0f} MiB ({error:+.0%})")


def test_planned_peak_matches_one_process_runs():
    _check(1)


def test_planned_peak_matches_two_process_runs():
    _check(2)


def test_planned_peak_matches_four_process_runs():
    _check(4)
