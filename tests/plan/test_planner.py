"""The planner: counts from the meta model, clear errors, and the planned per-rank peak against measured runs of
the product's Trainer (1, 2 and 4 processes; EP 1 and 2 with ZeRO-3; dense and MXFP4 experts; several sequence
lengths). The goal is 15 %; the test asserts 25 % so that a busy machine does not make it flaky."""

from __future__ import annotations


import pytest
import torch

from moe_plugin.plan.counts import count_model, rank_share
from moe_plugin.plan.planner import parse_bytes, plan_recipe
from moe_plugin.testing.plan_measure import (
    CALIBRATION,
    CHECKPOINTED_SHAPE,
    SHAPE,
    layout_recipe,
    measured_layouts,
    tensor_peak,
)
from moe_plugin.recipe.schema import LoraSection, recipe_from_dict


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
    with pytest.raises(ValueError, match="--capacity"):
        plan_recipe(recipe, devices=4, capacity=0.5)


def test_the_capacity_factor_is_the_recipes_unless_given():
    """The planner's dispatch assumption is the recipe's parallel.capacity_factor, the same key the trainer warns
    against; --capacity overrides it."""
    values = layout_recipe("/tmp/never", 4, 2, 256, shape=CALIBRATION)
    default = plan_recipe(recipe_from_dict(values), devices=4, summaries=False)
    values["parallel"]["capacity_factor"] = 2.0
    wide = plan_recipe(recipe_from_dict(values), devices=4, summaries=False)
    assert default.layout.capacity == 1.25 and wide.layout.capacity == 2.0
    assert (
        plan_recipe(recipe_from_dict(values), devices=4, capacity=1.25, summaries=False).memory.peak
        == default.memory.peak
    )
    assert wide.memory.peak > default.memory.peak  # more rows per local expert, larger all-to-all buffers


def test_a_checkpoint_base_has_no_preset_build_and_gpu_kernels_save_less():
    recipe = recipe_from_dict(layout_recipe("/tmp/never", 4, 2, 256))
    preset = plan_recipe(recipe, devices=4, summaries=False)
    loaded = plan_recipe(recipe, devices=4, from_checkpoint=True, summaries=False)
    assert preset.memory.build_peak > 0 and loaded.memory.build_peak == 0
    assert loaded.memory.step_peak == preset.memory.step_peak  # the step does not care how the base came
    gpu = plan_recipe(recipe, devices=4, kernels="gpu", summaries=False)
    assert gpu.memory.activations_by_segment["kda"] < preset.memory.activations_by_segment["kda"]
    assert gpu.memory.activations_by_segment["moe"] == preset.memory.activations_by_segment["moe"]
    with pytest.raises(ValueError, match="--kernels"):
        plan_recipe(recipe, devices=4, kernels="tpu")


@pytest.mark.parametrize(
    "expert_format,extras", [("dense", {}), ("mxfp4", dict(use_dsa_indexer=True, index_topk=64, attn_res=True))]
)
def test_meta_forward_saves_what_the_real_layer_saves(expert_format, extras):
    """Each layer kind run on meta (the planner) against the same layer run for real on the CPU: the bytes
    autograd saves per segment agree (balanced routing is exact here: N x top_k is a multiple of E)."""
    from moe_plugin.plan.activations import layer_saved_bytes
    from moe_plugin.plan.routing import BalancedDispatch
    from moe_plugin.recipe.resolved_model import base_hf_config

    recipe = recipe_from_dict(layout_recipe("/tmp/never", 1, 1, 256, expert_format, dict(SHAPE, **extras)))
    mc = base_hf_config(recipe.model).to_model_config()
    cands = 2 if mc.attn_res else 1
    for index in (0, 1, 3):  # KDA + dense MLP, KDA + MoE, MLA + MoE
        torch.manual_seed(0)
        real = layer_saved_bytes(mc, index, recipe.lora, (2, 256, mc.hidden_size), torch.float32, cands, "cpu")
        routing = BalancedDispatch(mc.moe.num_experts, 1.0)
        meta = layer_saved_bytes(
            mc, index, recipe.lora, (2, 256, mc.hidden_size), torch.float32, cands, routing=routing
        )
        assert set(real) == set(meta), (index, real, meta)
        for segment, value in real.items():
            assert meta[segment] == pytest.approx(value, rel=0.01), (index, segment, real, meta)


@pytest.mark.slow
def test_seed_layout_plan_by_hand():
    """The shipped seed layout: experts per device against the config's numbers (E x 3 x F x L per MoE layer,
    over EP 64 and the expert-data-parallel pair), BF16 and MXFP4; activations with full checkpointing are a
    [T, D] input per layer plus what each layer keeps, which is mostly each MoE layer's dispatched tokens
    (T x top-k x latent, never recomputed: layers.recompute), tens of GB at 1 x 4096 tokens; selective keeps
    more, off most."""
    from moe_plugin.recipe.schema import load_recipe

    recipe = load_recipe("recipes/k3_seed_layout.json")
    cache: dict = {}
    bf16 = plan_recipe(recipe, cache=cache)
    mxfp4 = plan_recipe(recipe, expert_format="mxfp4", cache=cache, summaries=False)
    ckpt = plan_recipe(recipe, checkpointing="full", cache=cache, summaries=False)
    mc = bf16.layout
    assert (mc.devices, mc.ep, mc.micro_batch, mc.seq_len) == (128, 64, 1, 4096)
    from moe_plugin.models import preset_config

    cfg = preset_config("k3").to_model_config()
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    e = cfg.moe
    experts = moe_layers * e.num_experts * 3 * e.expert_intermediate_size * e.expert_dim
    assert bf16.memory.base["experts"] == pytest.approx(experts * 2 / 64 / 2, rel=1e-3)
    # MXFP4: 4 bits a value plus one 8-bit scale per 32 values
    assert mxfp4.memory.base["experts"] == pytest.approx(experts * (0.5 + 1 / 32) / 64 / 2, rel=0.01)
    one_input = 4096 * cfg.hidden_size * 2
    assert ckpt.memory.activations_by_segment["layer inputs"] == pytest.approx(cfg.num_layers * one_input)
    dispatched = moe_layers * 4096 * e.top_k * e.expert_dim * 2  # bf16, before the capacity factor
    kept = ckpt.memory.activations_by_segment["kept by the layers"]
    assert dispatched <= kept < 2 * dispatched, (kept, dispatched)
    assert ckpt.memory.activations < bf16.memory.activations / 5
    selective = plan_recipe(recipe, checkpointing="selective", cache=cache, summaries=False)
    assert ckpt.memory.step_peak < selective.memory.step_peak < bf16.memory.step_peak  # (peak: the preset build)
    routing = plan_recipe(recipe, checkpointing="full_routing", cache=cache, summaries=False)
    assert bf16.modes == {
        "off": bf16.memory.peak,
        "selective": selective.memory.peak,
        "full": ckpt.memory.peak,
        "full_routing": routing.memory.peak,
    }
    # the MoE layers keep their routing, not their dispatched tokens
    assert routing.memory.activations_by_segment["kept by the layers"] < kept - dispatched / 2


def _profiled_peak(fn) -> tuple:
    """The real CPU run of ``fn`` under torch.profiler: (peak of tensor bytes, bytes still held at its end)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()
    events = prof.profiler.kineto_results.events()
    end = sum(e.nbytes() for e in events if e.name() == "[memory]")
    del kept
    return tensor_peak(events)["all"], end


@pytest.mark.parametrize("expert_format", ["dense", "mxfp4"])
def test_meta_working_bytes_match_the_allocator_of_a_real_layer(expert_format):
    """What a layer's forward holds beyond what it saves (the planner's dispatch-mode count on meta) against
    the real layer on the CPU, read off the allocator's events: its peak of tensor bytes less what its graph
    still holds with its result (what it leaves for backward); the head's forward + backward: its peak."""
    from moe_plugin.layers.decoder import DecoderLayer
    from moe_plugin.layers.norm import RMSNorm
    from moe_plugin.ops.losses import causal_lm_loss
    from moe_plugin.plan.activations import _add_lora, _head_bytes, layer_saved_bytes
    from moe_plugin.plan.routing import BalancedDispatch
    from moe_plugin.recipe.resolved_model import base_hf_config

    recipe = recipe_from_dict(layout_recipe("/tmp/never", 1, 1, 256, expert_format))
    mc = base_hf_config(recipe.model).to_model_config()
    shape = (1, 512, mc.hidden_size)
    cu = torch.tensor([0, 40, 100, 256, 300, 512])
    for index in (0, 1, 3):
        torch.manual_seed(0)
        layer = DecoderLayer(mc, index)
        _add_lora(layer, recipe.lora)
        state = (torch.randn(shape).requires_grad_(),)
        peak, held = _profiled_peak(lambda layer=layer, state=state: layer(state, cu_seqlens=cu))
        working: list = []
        routing = BalancedDispatch(mc.moe.num_experts, 1.0)
        layer_saved_bytes(
            mc, index, recipe.lora, shape, torch.float32, 1, cu_seqlens=cu, working=working, routing=routing
        )
        # the balanced dispatch's temporaries differ a little from the real routing's: a fifth, on a working set
        # that is itself a few per cent of a rank's peak
        assert working[0] == pytest.approx(peak - held, rel=0.2), (index, working, peak, held)
    norm_head = torch.nn.ModuleDict(
        {
            "norm": RMSNorm(mc.hidden_size, mc.rms_norm_eps),
            "lm_head": torch.nn.Linear(mc.hidden_size, mc.vocab_size, bias=False),
        }
    )
    _add_lora(norm_head, recipe.lora)
    hidden, labels = torch.randn(shape).requires_grad_(), torch.zeros(shape[:2], dtype=torch.long)

    def head():
        causal_lm_loss(norm_head["lm_head"](norm_head["norm"](hidden)), labels).backward()

    peak, _ = _profiled_peak(head)
    saved, working = _head_bytes(mc, shape, torch.float32, recipe.lora)
    # meta keeps every saved tensor to the end of the backward (an upper bound): 19 % over at this size
    assert saved + working == pytest.approx(peak, rel=0.25)
    # the loss's two fp32 gradients at its start: the logits' [N, V] and the shifted [N - 1, V]
    assert working >= (2 * shape[1] - 1) * mc.vocab_size * 4


def _check(world: int, measured_plans) -> None:
    planned, measured = measured_plans[f"world {world}"]  # one launch for every world (tests/plan/conftest.py)
    assert len(measured) == world
    layouts = measured_layouts(world)
    for rank in range(world):
        peaks = [m["peak_bytes"] for m in measured[rank]]
        overhead = peaks[0] - planned[0]  # the calibration layout: the framework's own memory
        assert abs(overhead) < 0.1 * min(peaks[1:]), (rank, overhead)  # tensor bytes: little outside the plan
        by_mode = {}
        for layout, plan, peak in zip(layouts, planned[1:], peaks[1:]):
            error = (plan + overhead - peak) / peak
            # the activation checkpointing layouts: within the 15 % (measured: 9 % at most)
            bound = 0.15 if layout[-1] is CHECKPOINTED_SHAPE else 0.25
            assert abs(error) < bound, (
                f"rank {rank}, layout {layout[:5]}: planned {(plan + overhead) / 2**20:.0f} "
                f"MiB, measured {peak / 2**20:.0f} MiB ({error:+.0%})"
            )
            if layout[-1] is CHECKPOINTED_SHAPE:
                by_mode[layout[4]] = (plan, peak)
        # the measured peak falls with checkpointing, as planned: to well under off's with either mode, and
        # "full" never above "selective" by more than the 15 % each plan may miss by (at these sizes full's larger
        # recomputed region, a whole KDA layer up to its router, costs about what its smaller kept set saves;
        # which of the two is lower depends on the rank's share of the dispatch, so no order is asserted)
        for column in (0, 1):  # planned, then measured
            off, selective, full = (by_mode[m][column] for m in ("off", "selective", "full"))
            assert max(selective, full) < 0.6 * off, (rank, off, selective, full)
            assert full < 1.15 * selective, (rank, off, selective, full)


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_peak_matches_one_process_runs(measured_plans):
    _check(1, measured_plans)


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_peak_matches_two_process_zero3_runs(measured_plans):
    """EP 1 and 2 under ZeRO-3 on 2 gloo processes, dense and MXFP4 experts, sequences of 256 to 1024."""
    _check(2, measured_plans)


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_peak_matches_four_process_zero3_runs(measured_plans):
    _check(4, measured_plans)


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_peak_matches_four_process_fsdp2_runs(measured_plans):
    """parallel.sharding "fsdp2" on 4 gloo processes (EP 2 and 1, dense and MXFP4 experts, 512 and 1024 tokens a
    row): every rank's measured peak within 15 % of ``plan --sharding fsdp2`` (measured: 5.4 % at most)."""
    from moe_plugin.testing.plan_measure import FSDP2_LAYOUTS

    planned, measured = measured_plans["fsdp2"]
    assert len(measured) == 4
    for rank, runs in enumerate(measured):
        overhead = runs[0]["peak_bytes"] - planned[0]  # the calibration layout: the framework's own memory
        for layout, plan, run in zip(FSDP2_LAYOUTS, planned[1:], runs[1:]):
            error = (plan + overhead - run["peak_bytes"]) / run["peak_bytes"]
            assert abs(error) < 0.15, (
                f"rank {rank}, layout {layout}: planned {(plan + overhead) / 2**20:.0f} MiB, measured "
                f"{run['peak_bytes'] / 2**20:.0f} MiB ({error:+.0%})"
            )


def test_fsdp2_plan_keeps_the_experts_whole_on_their_expert_rank():
    """``plan --sharding fsdp2`` of the seed layout (EP 64 on 128 devices): the routed experts stay whole on their
    EP rank (FSDP2's ignored_params: twice ZeRO-3's share, which splits them over the expert-data pair), everything
    else is sharded over all 128 ranks as under ZeRO-3, and the gathered parameters are the root's plus two
    decoder layers' (the one in use and the next), none of ZeRO-3's; DeepSpeed's linear is not planned."""
    from moe_plugin.plan.memory import GATHERED_TERM
    from moe_plugin.recipe.schema import load_recipe

    recipe = load_recipe("recipes/k3_seed_layout.json")
    cache: dict = {}
    zero3 = plan_recipe(recipe, cache=cache, summaries=False, checkpointing="full", from_checkpoint=True)
    fsdp2 = plan_recipe(
        recipe, cache=cache, summaries=False, checkpointing="full", from_checkpoint=True, sharding="fsdp2"
    )
    assert fsdp2.layout.sharding == "fsdp2" and not fsdp2.layout.zero3
    assert fsdp2.memory.base["experts"] == pytest.approx(2 * zero3.memory.base["experts"])
    assert fsdp2.memory.base["dense"] == pytest.approx(zero3.memory.base["dense"])
    from moe_plugin.plan.counts import count_model
    from moe_plugin.recipe.resolved_model import base_hf_config

    counts = count_model(base_hf_config(recipe.model), recipe.lora, precision_bytes=2, images=False)
    layers = [n - e for n, e in zip(counts.layer_numel, counts.layer_expert_numel)]
    root = counts.total_numel - sum(counts.layer_numel)
    assert fsdp2.memory.gathered == pytest.approx((root + 2 * max(layers)) * 2)  # bf16
    terms = fsdp2.memory.terms()
    assert GATHERED_TERM["fsdp2"] in terms and GATHERED_TERM["zero3"] not in terms
    # torch's linear keeps no frozen linear's input: the layers keep less than under ZeRO-3's DeepSpeed linear
    kept = "kept by the layers"
    assert fsdp2.memory.activations_by_segment[kept] < zero3.memory.activations_by_segment[kept]
    with pytest.raises(ValueError, match="--sharding"):
        plan_recipe(recipe, cache=cache, summaries=False, sharding="fsdp3")
