"""Context parallelism through the product's Trainer: the megatron image+text model (Attention Residuals on,
KDA and Gated DSA with its indexer) at CP 2 x EP 2 x ZeRO-3, at CP 4 x EP 2 and at CP 2 x EP 2 x FSDP2 on 4 gloo
processes equals one process: every step's loss, gradient norm, reduced adapter gradient and adapter, within
the fp32 bounds of tests/tolerances.py; with the per-document balance term (documents cut by the slices), with full
activation checkpointing, and without the indexer (as K3 ships), where the gated MLA attends head-parallel
(its 2 heads over CP 2); and the Hugging Face face on the hf backend at CP 2 x EP 2. Rows are packed so that
documents and images cross the slice boundaries.
Rank code: tests/training/context_parallel_workers.py."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_plugin.testing.launch import run_distributed
from tests.tolerances import check_run
from tests.training.test_multimodal_trainer import CHAIN, LR, MAX_NORM, TOKENS, _base, _data, _named, _recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/context_parallel_workers.py:run_recipes"
# name -> (context_parallel_size, expert_parallel_size, activation checkpointing, balance coefficient,
# parallel.moe_overlap_chunks: the 8 experts are 4 a rank at EP 2, base: the tiny preset with or without indexer)
LAYOUTS = {
    "cp2_ep2": (2, 2, "off", 0.0, 1, "indexer"),
    "cp2_ep2_balance": (2, 2, "off", 1.0, 1, "indexer"),
    "cp2_ep2_full": (2, 2, "full", 0.0, 2, "indexer"),
    "cp4_ep2": (4, 2, "off", 0.0, 4, "indexer"),
    "cp2_ep2_heads": (2, 2, "off", 0.0, 1, "heads"),
    # the Hugging Face face on the hf backend, the balance term on: the same row cut (training.context_rows)
    "hf_cp2_ep2_balance": (2, 2, "off", 1.0, 1, "indexer", "hf"),
    # FSDP2 over the data x context mesh (parallel.sharding), full activation checkpointing, the balance term on
    "fsdp2_cp2_ep2_full_balance": (2, 2, "full", 1.0, 1, "indexer", "megatron", "fsdp2"),
}


def _reference(layout):
    """The one-process run a layout is compared with."""
    return "ref_heads" if layout[5] == "heads" else "ref_balance" if layout[3] else "ref"


def _cp_recipe(
    tmp,
    name,
    bases,
    data,
    world,
    cp,
    ep,
    checkpointing,
    balance,
    chunks=1,
    base="indexer",
    backend="megatron",
    sharding="zero3",
):
    base = bases[base]
    recipe = _recipe(tmp, f"{name}-w{world}", base, data, backend, world, ep, checkpointing)
    if sharding != "zero3":
        recipe["deepspeed"], recipe["parallel"]["sharding"] = None, sharding
    recipe["parallel"]["context_parallel_size"] = cp
    recipe["parallel"]["moe_overlap_chunks"] = chunks
    recipe["schedule"]["micro_batch_size"] = 4 // (world // cp)  # the same 4 rows a step in every layout
    if balance:
        recipe["lora"]["router_balance"] = {"aux_loss_coeff": balance}
    return copy.deepcopy(recipe)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("context_parallel_trainer")
    bases = {"indexer": tmp / "base", "heads": tmp / "base_heads"}
    _base(bases["indexer"])
    _base(bases["heads"], use_dsa_indexer=False)
    data = _data(tmp)
    refs = {"ref": (0.0, "indexer"), "ref_balance": (1.0, "indexer"), "ref_heads": (0.0, "heads")}
    one_recipes = [
        _cp_recipe(tmp, name, bases, data, 1, 1, 1, "off", balance, base=base) for name, (balance, base) in refs.items()
    ]
    one = run_distributed(WORKER, world_size=1, timeout_s=900, recipes=one_recipes)[0]
    four = run_distributed(
        WORKER,
        world_size=4,
        timeout_s=1800,
        recipes=[_cp_recipe(tmp, name, bases, data, 4, *layout) for name, layout in LAYOUTS.items()],
    )
    by_name = {name: [ranks[i] for ranks in four] for i, name in enumerate(LAYOUTS)}
    by_name["overlap"] = [ranks[len(LAYOUTS)]["overlap"] for ranks in four]
    return dict(zip(refs, one)), by_name


def test_the_layouts_are_what_the_recipes_ask(runs):
    _, four = runs
    for name, (cp, ep, *_) in LAYOUTS.items():
        got = four[name]
        sizes = {(r["layout"]["context"], r["layout"]["expert"], r["layout"]["data"]) for r in got}
        assert sizes == {(cp, ep, 4 // cp)}
        assert sorted((r["dp_rank"], r["context_rank"]) for r in got) == sorted(
            (d, c) for d in range(4 // cp) for c in range(cp)
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_one_process(runs, name):
    one, four = runs
    ref = one[_reference(LAYOUTS[name])]
    assert all(abs(loss) > 0 for loss in ref["losses"])
    for rank, got in enumerate(four[name]):
        failures = check_run(_named(ref), _named(got), tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
        assert not failures, (name, rank, failures[:8])


def test_the_balance_term_moves_the_gradients(runs):
    """Premise of the balance row: with coefficient 1 the router's adapter gradients differ from the plain run's,
    so equality with one process checks the cross-slice document statistics."""
    one, _ = runs
    plain, balanced = one["ref"]["step_grads"][0], one["ref_balance"]["step_grads"][0]
    gate = [n for n in plain if ".gate." in n and "lora_B" in n]
    assert gate and any(float((plain[n] - balanced[n]).abs().max()) > 1e-6 for n in gate)


def test_overlapped_chunks_are_bitwise_the_sequential_schedule(runs):
    """CP 2 x EP 2 x ZeRO-3 with full activation checkpointing in 2 overlapped chunks trains bit for bit as the
    same layout without checkpointing in 1 (recompute and chunks both change no bit): every step's loss, gradient
    norm and adapter."""
    _, four = runs
    for rank, (chunked, plain) in enumerate(zip(four["cp2_ep2_full"], four["cp2_ep2"])):
        assert chunked["losses"] == plain["losses"], (rank, chunked["losses"], plain["losses"])
        assert chunked["grad_norms"] == plain["grad_norms"], rank
        for step, (a, b) in enumerate(zip(chunked["adapters"], plain["adapters"])):
            differ = [n for n in b if not torch.equal(a[n], b[n])]
            assert not differ, (rank, step, differ[:4])


def test_overlapped_dispatch_is_bitwise_the_sequential_one_at_ep4(runs):
    """The MoE layer at EP 4 (the launch's 4 ranks) in 1, 2 and 4 chunks, recompute off and full: bit for bit
    (moe_plugin.testing.expert_dispatch.overlap_parity), and both planted bugs caught."""
    from moe_plugin.testing.expert_dispatch import overlap_failures

    _, four = runs
    assert {r["ep"] for r in four["overlap"]} == {4}
    assert not overlap_failures(four["overlap"]), overlap_failures(four["overlap"])


def test_exposed_all_to_all_time_is_logged(runs):
    """Every logged step under expert parallelism reports moe/a2a_exposed_s, the seconds a rank was blocked on
    the expert all-to-alls (at least the counts' exchange, which nothing overlaps); one process has none."""
    one, four = runs
    for name in ("cp2_ep2", "cp4_ep2"):
        for rank, got in enumerate(four[name]):
            exposed = [step["moe/a2a_exposed_s"] for step in got["logged"]]
            assert len(exposed) == len(got["losses"]) and all(0 < s < 60 for s in exposed), (name, rank, exposed)
    assert all("moe/a2a_exposed_s" not in step for step in one["ref"]["logged"])
