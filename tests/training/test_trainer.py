"""The trainer on 4 gloo processes (EP=2 x expert-data-parallel 2, ZeRO-3, and FSDP2) equals one process, and
resumes bitwise; both through the product's ``Trainer``/``train`` (tests/training/trainer_workers.py). One launch
of 4 processes and one of 1 run every scenario."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from moe_plugin.recipe.schema import DEFAULT_ROUTER_AUX_LOSS_COEFF
from tests.recipes import TINY, recipe, whole
from tests.tolerances import chain_length, chain_rel, check_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/trainer_workers.py:run_all"
LR = 2e-2
MAX_NORM = 0.05
TOKENS = 4 * 64  # a step's global batch: 4 rows of seq_len 64, at most that many label tokens
CHAIN = chain_length(TOKENS, layers=4, width=128, vocab=384)  # the tiny preset: hidden 64, MLP 128


def _recipe(output_dir, world: int, ep: int, steps: int = 3, model=None, backend="megatron", **schedule) -> dict:
    # micro-batch 4 in one process is the concatenation of the 4 ranks' micro-batches of 1
    return recipe(
        output_dir,
        world=world,
        ep=ep,
        model=whole(model or TINY),
        parallel={"backend": backend},
        schedule={"steps": steps, "lr": LR, "clip_grad_norm": MAX_NORM, **schedule},
        checkpoint={"keep": 2},
    )


ROUTINGS = ("free", "empty_expert", "one_ep_rank")
AUX = "balance_loss"  # the free routing with a strong balance loss: its gradient is a large part of the router's
CHECKPOINTS = ("hf_checkpoint", "k3_checkpoint", "hf_backend", "hf_backend_ep")
FSDP2 = "fsdp2"  # the free routing under parallel.sharding "fsdp2" (no DeepSpeed config)


def _fsdp2(recipe_dict: dict, output_dir) -> dict:
    out = copy.deepcopy(recipe_dict)
    out.update(output_dir=str(output_dir), deepspeed=None)
    out["parallel"]["sharding"] = FSDP2
    return out


def _checkpoints(tmp) -> dict:
    """A trained-looking base in both layouts: the tiny model (AttnRes off) with its selection bias moved, so
    that loading it (and not the seed) is what the runs see."""
    from moe_plugin.models import MoEPluginForCausalLM, preset_config
    from moe_plugin.models.k3_format import save_k3_checkpoint

    torch.manual_seed(11)
    model = MoEPluginForCausalLM(preset_config("tiny", attn_res=False))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.01)
    model.save_pretrained(tmp / "base_hf")
    save_k3_checkpoint(model, tmp / "base_k3")
    for base in ("base_hf", "base_k3"):  # a base brings its tokenizer: these bases' ids are the byte tokenizer's
        ByteTokenizer().save_pretrained(tmp / base)
    return {
        "hf_checkpoint": {"from_pretrained": str(tmp / "base_hf")},
        "k3_checkpoint": {"from_pretrained": str(tmp / "base_k3")},
        "hf_backend": {"from_pretrained": str(tmp / "base_hf")},
        "hf_backend_ep": {"from_pretrained": str(tmp / "base_hf")},
    }


def _scenarios(tmp, world: int, ep: int, bases: dict) -> list:
    out = [
        {
            "name": routing,
            "routing": routing,
            "inspect": routing == "free",
            "recipe": _recipe(tmp / f"{routing}-w{world}", world, ep),
        }
        for routing in ROUTINGS
    ]
    strong = _recipe(tmp / f"{AUX}-w{world}", world, ep)
    strong["lora"]["router_balance"] = {"aux_loss_coeff": 1.0}
    out.append({"name": AUX, "recipe": strong})
    for name in CHECKPOINTS:
        backend = "hf" if name.startswith("hf_backend") else "megatron"
        out.append(
            {
                "name": name,
                "recipe": _recipe(
                    tmp / f"{name}-w{world}",
                    world,
                    1 if name == "hf_backend" else ep,
                    model=bases[name],
                    backend=backend,
                ),
            }
        )
    return out


def _resume_recipes(tmp, world: int, ep: int):
    """An uninterrupted run, and the same recipe stopped after 2 of its 4 steps and started again."""
    whole = _recipe(tmp / "whole", world, ep, steps=4, warmup_steps=1)
    whole["checkpoint"]["every"] = 2
    stopped = copy.deepcopy(whole)
    stopped["output_dir"] = str(tmp / "stopped")
    return [whole], {"recipe_dict": stopped, "stop_after": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    bases = _checkpoints(tmp)
    accumulation = {"name": "accumulation", "recipe": _recipe(tmp / "accumulation-w1", 1, 1)}
    accumulation["recipe"]["schedule"].update(micro_batch_size=1, gradient_accumulation_steps=4)
    accumulation_fsdp2 = {"name": "accumulation_fsdp2", "recipe": _fsdp2(accumulation["recipe"], tmp / "acc-fsdp2")}
    planted = {
        "name": "planted",
        "recipe": _fsdp2(accumulation["recipe"], tmp / "planted-fsdp2"),
        "plant": "adapter_after_sharding",
    }
    one = run_distributed(
        WORKER,
        world_size=1,
        timeout_s=900,
        recipes=[],
        scenarios=_scenarios(tmp, 1, 1, bases) + [accumulation, accumulation_fsdp2, planted],
    )
    recipes, resume = _resume_recipes(tmp, 4, 2)
    fsdp2 = {"name": FSDP2, "recipe": _fsdp2(_recipe(tmp, 4, 2), tmp / "fsdp2-w4")}
    four = run_distributed(
        WORKER,
        world_size=4,
        timeout_s=1800,
        scenarios=_scenarios(tmp, 4, 2, bases) + [fsdp2],
        recipes=recipes,
        resume=resume,
    )
    return one[0], four


@pytest.mark.parametrize("routing", ROUTINGS + (AUX,) + CHECKPOINTS)
def test_ep2_zero3_on_4_processes_equals_one_process(runs, routing):
    """ROUTINGS: a preset base with free routing, an expert that gets no token, every token on EP rank 0's
    experts (each with the default balance loss: the seed's targets adapt the router); AUX: free routing with
    the balance loss at coefficient 1. CHECKPOINTS: a base loaded under zero.Init, each rank streaming its slices into
    its partitions, from a Hugging Face and a K3-layout checkpoint (megatron, EP=2), and the Hugging Face backend
    (ZeRO-3 data parallel over 4 ranks, and EP=2 x ZeRO-3 from the recipe: expert parallelism applied from
    outside the Hugging Face model, its experts re-read from the checkpoint). Losses, gradient norms, every
    gradient element and every adapter element after each step, within the fp32 bounds of tests/tolerances.py."""
    one, four = runs
    ref = one["scenarios"][routing]
    assert len(ref["losses"]) == 3 and min(ref["grad_norms"]) > MAX_NORM  # clipping active on every step
    for rank, result in enumerate(four):
        failures = check_run(ref, result["scenarios"][routing], tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
        assert not failures, (rank, failures[:8])
    if routing == "empty_expert":  # expert 0 got no token: its adapter gradient is exactly zero
        # (lora_B: lora_A's first-step gradient is zero for every expert, since lora_B starts at zero)
        for name in [n for n in ref["grads"] if "experts" in n and "lora_B" in n]:
            g = ref["grads"][name]
            per_expert = g.view(g.shape[0], -1, 8)  # [out, r * E] with expert-minor columns
            assert torch.count_nonzero(per_expert[:, :, 0]) == 0, name
            assert torch.count_nonzero(per_expert[:, :, 1:]) > 0, name


def test_fsdp2_at_ep2_on_4_processes_equals_one_process(runs):
    """FSDP2 (``fully_shard`` per decoder layer and the root over the 4 ranks, the routed experts and their
    adapters whole on their EP rank, reduced within their expert-data pair) trains as one process does: losses,
    gradient norms, every gradient and adapter element within the fp32 bounds, with clipping active on every
    step. The clip's norm is one over both meshes: leaving the experts' part out fails step 1's gradient norm by
    5x the bound (planted by hand). On one process, FSDP2 with 4 accumulated micro-batches equals DeepSpeed's
    (the loss divided by the micro-batch count, the gradients reduced once)."""
    one, four = runs
    ref = one["scenarios"]["free"]
    for rank, result in enumerate(four):
        got = result["scenarios"][FSDP2]
        assert got["engine"].startswith("FSDP2 over 4 ranks"), got["engine"]
        failures = check_run(ref, got, tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
        assert not failures, (rank, failures[:8])
    ref, got = one["scenarios"]["accumulation"], one["scenarios"]["accumulation_fsdp2"]
    assert got["engine"].startswith("FSDP2") and ref["engine"] == "ZeRO stage 0"
    failures = check_run(ref, got, tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
    assert not failures, failures[:8]


def test_an_adapter_attached_after_fsdp2_sharded_the_model_stops_the_step(runs):
    """The planted bug of transformers #48792 (an adapter put on after ``fully_shard``: a plain tensor each rank
    trains on its own, rank 0's saved): the FSDP2 engine's step refuses it by name before any update."""
    error = runs[0]["scenarios"]["planted"]["error"]
    assert error is not None
    assert "lora_planted" in error and "outside FSDP2's shards" in error, error


def test_the_balance_term_is_the_same_in_every_layout_and_on_both_backends(runs):
    """Per document, the term does not depend on where a document is routed: step 1's logged ``moe/aux_loss`` (the
    adapters still the base's) is one process's on 4 processes (EP 2 x ZeRO-3 megatron, ZeRO-3 hf) and the same
    on the megatron and the Hugging Face face of one base; the strong term moves the router's adapter."""
    one, four = runs
    rel = chain_rel(CHAIN)
    for name in (AUX, "free", "hf_checkpoint", "hf_backend"):
        want = one["scenarios"][name]["logged"][0]
        assert want["moe/aux_loss"] > 0 and set(want) >= {"moe/layer1/aux_loss", "moe/rank_load_max_over_mean"}
        for rank, result in enumerate(four):
            got = result["scenarios"][name]["logged"][0]
            for key in (k for k in want if k.endswith("aux_loss")):
                assert got[key] == pytest.approx(want[key], rel=rel), (name, rank, key)
    megatron, hf = one["scenarios"]["hf_checkpoint"]["logged"][0], one["scenarios"]["hf_backend"]["logged"][0]
    for key in (k for k in megatron if k.endswith("aux_loss")):
        assert hf[key] == pytest.approx(megatron[key], rel=1e-5), key
    # coefficient 1 against the default: a larger term, and another gradient for the router's adapter
    free, strong = one["scenarios"]["free"], one["scenarios"][AUX]
    ratio = 1.0 / DEFAULT_ROUTER_AUX_LOSS_COEFF
    assert strong["logged"][0]["moe/aux_loss"] == pytest.approx(ratio * free["logged"][0]["moe/aux_loss"], rel=1e-6)
    gate_grads = [n for n in strong["step_grads"][0] if ".gate.lora_B" in n]
    assert gate_grads and all(
        not torch.allclose(strong["step_grads"][0][n], free["step_grads"][0][n]) for n in gate_grads
    )


def test_zero3_partitions_within_the_right_groups(runs):
    one, four = runs
    ref_experts = one["scenarios"]["free"]["experts"]
    for rank, result in enumerate(four):
        got = result["scenarios"]["free"]
        parts = got["partitions"]
        assert parts, "nothing was partitioned"
        kinds = {"expert": 0, "dense": 0, "frozen": 0}
        for name, (stored, full, expert, trainable) in parts.items():
            group = 2 if expert else 4  # experts within their expert-data-parallel pair, the rest over all 4
            assert stored == math.ceil(full / group), (rank, name, stored, full)
            kinds["expert" if expert else "dense"] += 1
            kinds["frozen"] += not trainable
        assert min(kinds.values()) > 0, kinds
        for layer, (first, w1) in got["experts"].items():
            ref_first, ref_w1 = ref_experts[layer]
            assert ref_first == 0 and first == (rank % 2) * w1.shape[0]  # EP groups are [0,1] and [2,3]
            assert torch.equal(w1, ref_w1[first : first + w1.shape[0]]), (rank, layer)


def test_resume_gives_the_uninterrupted_losses_bitwise(runs):
    _, four = runs
    whole = four[0]["recipes"][0]
    before, after = four[0]["resume"]["before"], four[0]["resume"]["after"]
    assert whole["resumed_from"] is None and after["resumed_from"] == 2
    assert len(whole["losses"]) == 4 and before == whole["losses"][:2]
    assert after["losses"] == whole["losses"]  # exact: bitwise on CPU, the resumed steps included


def test_gradient_accumulation_equals_the_larger_micro_batch(runs):
    """One process, 4 accumulated micro-batches of 1 row: the same steps as one micro-batch of 4 rows."""
    one, _ = runs
    ref, got = one["scenarios"]["free"], one["scenarios"]["accumulation"]
    failures = check_run(ref, got, tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
    assert not failures, failures[:8]
