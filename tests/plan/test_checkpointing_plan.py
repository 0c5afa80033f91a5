"""The planner's activation checkpointing (moe_plugin/plan/checkpointing.py) reads what a mode keeps off the
trainer's own layers: the meta run keeps what the real CPU layer keeps in each mode and layer kind, and holds at
most what it holds over its forward and backward with the recomputes, a change of
the layers' table (layers.recompute.RECOMPUTED) changes the plan, and ``moe-plugin plan --checkpointing`` takes
the modes by the recipe's names and says which fits."""

from __future__ import annotations

import json

import pytest
import torch

from moe_plugin.layers import recompute
from moe_plugin.models import preset_config
from moe_plugin.plan.activations import _state_shape, layer_saved_bytes, packed_boundaries
from moe_plugin.plan.checkpointing import plan_checkpointed
from moe_plugin.plan.command import main
from moe_plugin.plan.routing import BalancedDispatch
from moe_plugin.recipe.schema import LoraSection

MC = preset_config("tiny").to_model_config()  # Attention Residuals on, KDA and MLA, dense and MoE layers
SHAPE = (1, 256, MC.hidden_size)


@pytest.mark.parametrize("mode", ["selective", "full", "full_routing"])
def test_meta_keeps_what_the_real_layer_keeps(mode):
    cu = packed_boundaries(1, 256, [100, 156])
    lora = LoraSection()
    for index in range(MC.num_layers):  # KDA + dense, KDA + MoE (in a block and closing it), MLA + MoE
        cands = len(_state_shape(index, MC))
        torch.manual_seed(0)
        real = sum(layer_saved_bytes(MC, index, lora, SHAPE, torch.float32, cands, "cpu", cu, mode=mode).values())
        real_peak: list = []
        layer_saved_bytes(MC, index, lora, SHAPE, torch.float32, cands, "cpu", cu, mode=mode, peak=real_peak)
        run = dict(cu_seqlens=cu, mode=mode, routing=BalancedDispatch(MC.moe.num_experts, 1.0))
        meta = sum(layer_saved_bytes(MC, index, lora, SHAPE, torch.float32, cands, **run).values())
        peak: list = []
        layer_saved_bytes(MC, index, lora, SHAPE, torch.float32, cands, peak=peak, **run)
        assert meta == pytest.approx(real, rel=0.01), (index, meta, real)
        # the forward's and backward's most at once: the balanced dispatch makes slightly other temporaries
        assert peak[0] == pytest.approx(real_peak[0], rel=0.1), (index, peak, real_peak)
        assert peak[0] > meta, (index, peak, meta)
        off = sum(layer_saved_bytes(MC, index, lora, SHAPE, torch.float32, cands, "cpu", cu).values())
        assert real < (off if mode == "selective" else off / 2), (index, real, off)


def test_the_plan_follows_the_layers_table(monkeypatch):
    """Without "experts" in full's regions the layers keep the experts' saved sets, and the plan says so."""
    args = (MC, LoraSection(), 1, 256, MC.moe.num_experts, 1.0, torch.float32)
    planned = plan_checkpointed(*args, {}, None, "cpu", "full")
    monkeypatch.setitem(recompute.RECOMPUTED, "full", recompute.RECOMPUTED["full"] - {"experts"})
    without = plan_checkpointed(*args, {}, None, "cpu", "full")
    moe = [i for i in range(MC.num_layers) if MC.is_moe_layer(i)]
    assert all(without.kept[i] > planned.kept[i] for i in moe)
    assert all(without.kept[i] == planned.kept[i] for i in range(MC.num_layers) if i not in moe)


@pytest.mark.slow
def test_plan_command_takes_the_modes_and_says_which_fits(tmp_path, capsys):
    recipe = tmp_path / "r.json"
    recipe.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "out"),
                "model": {"preset": "tiny"},
                "schedule": {"activation_checkpointing": "selective", "micro_batch_size": 1},
                "data": {"seq_len": 512},
            }
        )
    )
    plan_args = ["--recipe", str(recipe), "--devices", "1", "--from-checkpoint"]  # no whole-preset build peak
    assert main(plan_args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["checkpointing"] == "selective"  # the recipe's mode unless --checkpointing says
    peaks = plan["modes"]
    assert peaks["selective"] == plan["memory"]["peak"] and peaks["off"] > max(peaks["selective"], peaks["full"])
    memory = f"{(peaks['off'] + max(peaks['selective'], peaks['full'])) / 2 / 1e9:.6f}GB"
    assert main(plan_args + ["--checkpointing", "full", "--device-memory", memory]) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing full" in out and "modes that fit: selective, full" in out
    assert main(plan_args + ["--checkpointing", "on"]) == 2
    assert "--checkpointing" in capsys.readouterr().err


def test_full_routing_keeps_the_routing_not_the_dispatched_tokens():
    """ "full_routing" recomputes the MoE's dispatch in the backward: an MoE layer keeps less than under "full" by
    at least its dispatched tokens (N x top_k latent rows); a dense layer keeps the same."""
    args = (MC, LoraSection(), 1, 256, MC.moe.num_experts, 1.0, torch.float32)
    full = plan_checkpointed(*args, {}, None, "cpu", "full")
    routing = plan_checkpointed(*args, {}, None, "cpu", "full_routing")
    dispatched = 256 * MC.moe.top_k * MC.moe.expert_dim * 4
    for i in range(MC.num_layers):
        if MC.is_moe_layer(i):
            assert routing.kept[i] <= full.kept[i] - dispatched, (i, routing.kept[i], full.kept[i], dispatched)
        else:
            assert routing.kept[i] == full.kept[i], i
