"""megatron-core's GPTModel built from moe_plugin's specs, against the Hugging Face model with the same weights.

Two launches (rank code in model_workers.py): world 2 with EP=1 and EP=2 (data-parallel size 2 in both), and
world 4 with EP=1, 2 and 4. Every rank gets its own micro-batch; the reference is the Hugging Face model with the
same checkpoint and LoRA adapters on the concatenated batch, computed here. Scenarios: "mixed" (free routing
except expert 1, which the selection bias keeps empty) and "one_expert" (top-1, every token on expert 6, so
some EP ranks receive nothing); at world 4 also "grouped" (top-4 of 8 experts in 4 groups, best 2 groups
eligible: more choices per token than experts per EP=4 rank). The world-2 launch also loads a K3-layout checkpoint
(``save_k3_checkpoint``: per-expert tensors, padded ``A_log``) per EP=2 rank with ``load_k3_checkpoint_per_rank``.
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_plugin.lora import add_lora, lora_config
from moe_plugin.ops.losses import causal_lm_loss
from moe_plugin.models.k3_format import load_k3_checkpoint, save_k3_checkpoint
from moe_plugin.models.modeling import MoEPluginForCausalLM
from moe_plugin.models.presets import preset_config
from moe_plugin.testing.launch import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts processes

TOL = 1e-5
WORKERS = Path(__file__).with_name("model_workers.py")
LORA = dict(
    r=4,
    alpha=8,
    target_modules=["q_proj", "k_proj", "gate"],
    target_parameters=["experts.w1", "experts.w2", "experts.w3"],
)
SCENARIOS = {
    "mixed": ({}, ("avoid", 1)),
    "one_expert": (dict(num_experts_per_token=1, moe_renormalize=False), ("force", 6)),
    # top_k (4) above the experts per rank at EP=4 (2), group-limited: 4 groups of 2, best 2 eligible
    "grouped": (dict(num_experts_per_token=4, num_expert_group=4, topk_group=2), None),
}
WORLD2_SCENARIOS, WORLD4_SCENARIOS = ["mixed", "one_expert"], ["mixed", "grouped"]
BATCH, SEQ, WORLD_MAX = 2, 16, 4
PACKED_CU = torch.tensor([0, 5, 11, 16])


def hf_config(**overrides):
    return preset_config("tiny", attn_res=False, vision_config=None, image_token_id=None, **overrides)


def build_reference(scenario: str, seed: int = 0, **extra) -> MoEPluginForCausalLM:
    """The tiny model with well-separated router scores and the scenario's selection bias (no LoRA yet);
    ``extra``: more config overrides."""
    overrides, rule = SCENARIOS[scenario]
    torch.manual_seed(seed)
    model = MoEPluginForCausalLM(hf_config(**overrides, **extra))
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                gate = layer.block_sparse_moe.gate
                gate.weight.normal_(0.0, 0.3)  # routing far from ties: no flips from rounding differences
                gate.e_score_correction_bias.normal_(0.0, 0.05)
                if rule is not None:
                    kind, expert = rule
                    gate.e_score_correction_bias[expert] = -10.0 if kind == "avoid" else 10.0
    return model


def add_reference_lora(model, seed: int = 1):
    add_lora(model, lora_config(LORA["r"], LORA["alpha"], LORA["target_modules"], LORA["target_parameters"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # peft starts B at zero: the A gradients would be zero too
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Checkpoints, adapters and micro-batches on disk; the Hugging Face models with LoRA for the references."""
    root = tmp_path_factory.mktemp("megatron_model")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 384, (BATCH, SEQ), generator=g) for _ in range(WORLD_MAX)]
    packed = [torch.randint(0, 384, (1, SEQ), generator=g) for _ in range(WORLD_MAX)]
    models = {}
    for scenario in SCENARIOS:
        model = build_reference(scenario)
        model.save_pretrained(root / scenario, max_shard_size="100KB")
        adapters = add_reference_lora(model)
        torch.save(
            {"lora": LORA, "adapters": adapters, "batches": batches, "packed": packed, "packed_cu_seqlens": PACKED_CU},
            root / scenario / "setup.pt",
        )
        models[scenario] = model
    save_k3_checkpoint(build_reference("mixed", seed=3, use_dsa_indexer=False), root / "k3", max_shard_size="100KB")
    k3 = {}
    for f in sorted((root / "k3").glob("*.safetensors")):
        k3.update(load_file(str(f)))
    k3.pop("model.layers.2.block_sparse_moe.experts.5.w2.weight")
    k3["model.layers.2.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(1)  # an expert the model lacks
    (root / "broken" / "k3").mkdir(parents=True)
    save_file(k3, str(root / "broken" / "k3" / "model.safetensors"))
    state = {k: v.detach().clone().contiguous() for k, v in build_reference("mixed").state_dict().items()}
    for name, broken in (
        ("missing", {k: v for k, v in state.items() if k != "model.norm.weight"}),
        ("unexpected", state | {"model.layers.9.self_attn.q_proj.weight": torch.zeros(1)}),
    ):
        (root / "broken" / name).mkdir()
        save_file(broken, str(root / "broken" / name / "model.safetensors"))
    return {"root": root, "models": models, "batches": batches, "packed": packed}


def _reference(model, batches):
    """Logits per micro-batch, loss and adapter gradients of the Hugging Face model on the concatenated batch."""
    model.zero_grad(set_to_none=True)
    tokens = torch.cat(batches)
    out = model(input_ids=tokens)
    loss = causal_lm_loss(out.logits, tokens)
    loss.backward()
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
        if ".lora_" in n
    }
    return {"logits": out.logits.detach().split(BATCH), "loss": loss.detach(), "grads": grads}


def _launch(case, world, layouts, scenarios, extras):
    results = run_distributed(
        f"{WORKERS}:run_model_checks",
        world_size=world,
        timeout_s=400,
        case_dir=str(case["root"]),
        layouts=layouts,
        scenarios=scenarios,
        extras=extras,
    )
    for rank, result in enumerate(results):
        for name, got in result.items():
            if "error" in got:
                pytest.fail(f"{name} raised on rank {rank}:\n{got['error']}", pytrace=False)
    return results


@pytest.fixture(scope="module")
def world2(case):
    results = _launch(case, 2, [1, 2], WORLD2_SCENARIOS, extras=True)
    refs = {s: _reference(case["models"][s], case["batches"][:2]) for s in WORLD2_SCENARIOS}
    return results, refs


@pytest.fixture(scope="module")
def world4(case):
    results = _launch(case, 4, [1, 2, 4], WORLD4_SCENARIOS, extras=False)
    return results, {s: _reference(case["models"][s], case["batches"][:4]) for s in WORLD4_SCENARIOS}


def _rel(a, b):
    diff, scale = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / scale if scale > 0 else diff


def _compare_grads(got, want, where):
    assert set(got) == set(want), f"{where}: adapter names differ: {sorted(set(got) ^ set(want))[:4]}"
    for name, value in want.items():
        err = _rel(got[name], value)
        assert err <= TOL, f"{where}: grad of {name}: rel err {err:.2e}"


@pytest.mark.parametrize("scenario", WORLD2_SCENARIOS)
def test_ep1_matches_hf_logits_and_lora_grads(world2, scenario):
    results, refs = world2
    ref = refs[scenario]
    for rank, result in enumerate(results):
        got = result[f"{scenario}/ep1"]
        assert got["ep"] == 1 and got["dp"] == 2
        err = _rel(got["logits"], ref["logits"][rank])
        assert err <= TOL, f"rank {rank}: logits rel err {err:.2e} vs the HF model"
        _compare_grads(got["grads"], ref["grads"], f"rank {rank} EP=1")
    mean_loss = sum(r[f"{scenario}/ep1"]["loss"] for r in results) / len(results)
    assert _rel(mean_loss, ref["loss"]) <= TOL


@pytest.mark.parametrize(
    "world, ep, scenario",
    [(2, 2, "mixed"), (2, 2, "one_expert"), (4, 2, "mixed"), (4, 4, "mixed"), (4, 2, "grouped"), (4, 4, "grouped")],
)
def test_expert_parallel_matches_ep1_and_hf(world2, world4, world, ep, scenario):
    results, refs = world2 if world == 2 else world4
    ref = refs[scenario]
    for rank, result in enumerate(results):
        got, ep1 = result[f"{scenario}/ep{ep}"], result[f"{scenario}/ep1"]
        assert (got["ep"], got["dp"], got["edp"]) == (ep, world, world // ep)
        assert _rel(got["loss"], ep1["loss"]) <= TOL, f"rank {rank}: EP={ep} loss differs from EP=1"
        err = _rel(got["logits"], ref["logits"][rank])
        assert err <= TOL, f"rank {rank}: EP={ep} logits rel err {err:.2e} vs the HF model"
        _compare_grads(got["grads"], ep1["grads"], f"rank {rank} EP={ep} vs EP=1")
        _compare_grads(got["grads"], ref["grads"], f"rank {rank} EP={ep} vs HF on the concatenated batch")
        experts = 8 // ep
        first = (rank % ep) * experts
        assert set(got["local"].values()) == {(first, first + experts)}, got["local"]
    mean_loss = sum(r[f"{scenario}/ep{ep}"]["loss"] for r in results) / len(results)
    assert _rel(mean_loss, ref["loss"]) <= TOL, "the mean of the ranks' losses is the concatenated batch's loss"


def test_expert_adapters_reduced_over_expert_data_parallel_group(world2, world4):
    for results, ep in ((world2[0], 2), (world4[0], 2), (world4[0], 4)):
        counts = results[0][f"mixed/ep{ep}"]["counts"]
        # 3 MoE layers x 3 expert weights x (A, B); q/k on 3 KDA layers and the 3 routers x (A, B)
        assert counts["expert"] == 18 and counts["dense"] == 18, counts


def test_starved_expert_gets_no_tokens_and_zero_grads(world2, world4):
    for results in (world2[0], world4[0]):
        load = sum(torch.stack(r["mixed/ep1"]["loads"]) for r in results)
        assert (load[:, 1] == 0).all() and (load[:, [0, 2, 3, 4, 5, 6, 7]] > 0).all(), f"premise: {load}"
        for r in results:
            for name, grad in r["mixed/ep2"]["grads"].items():
                if ".experts." in name and ".lora_A." in name:
                    assert grad.view(8, LORA["r"], -1)[1].abs().sum() == 0, f"{name}: starved expert has a gradient"
    # EP=4: rank 0 holds experts 0 and 1; expert 1 computes nothing in any layer
    received = world4[0][0]["mixed/ep4"]["received"]
    assert all(r.tolist()[1] == 0 and r.tolist()[0] > 0 for r in received), received


def test_all_tokens_on_one_expert(world2):
    results, _ = world2
    tokens = 2 * BATCH * SEQ
    load = sum(torch.stack(r["one_expert/ep1"]["loads"]) for r in results)
    assert (load[:, 6] == tokens).all() and load.sum() == 3 * tokens, f"premise: {load}"
    assert all(r.sum() == 0 for r in results[0]["one_expert/ep2"]["received"]), "EP rank 0 must receive nothing"
    assert all(r.tolist() == [0, 0, tokens, 0] for r in results[1]["one_expert/ep2"]["received"])


def test_grouped_routing_premise(world4):
    """Each token's 4 experts lie in exactly 2 of the 4 groups (at EP=4, 2 ranks), and the groups vary."""
    results, _ = world4
    tokens = 4 * BATCH * SEQ
    load = sum(torch.stack(r["grouped/ep1"]["loads"]) for r in results)
    assert (load.sum(1) == 4 * tokens).all(), f"premise: {load}"
    assert ((load > 0).sum(1) >= 6).all(), f"premise: routing must spread over the groups, got {load}"
    for rank, result in enumerate(results):
        for ep in (1, 4):
            groups = result[f"grouped/ep{ep}"]["groups_used"]
            assert groups == [2] * len(groups), f"rank {rank} EP={ep}: groups per token {groups}"


def test_dispatcher_moves_latent_width_tokens_through_the_model(world2):
    results, _ = world2
    latent, hidden = 32, 64
    for rank, result in enumerate(results):
        for scenario in WORLD2_SCENARIOS:
            top_k = 1 if scenario == "one_expert" else 2
            widths = result[f"{scenario}/ep2"]["widths"]
            assert widths == [(BATCH * SEQ * top_k, latent)] * 3, f"rank {rank} {scenario}: {widths} (hidden {hidden})"


def test_schedule_of_attention_and_mlp_kinds(world2):
    got = world2[0][0]["mixed/ep2"]["layer_types"]
    assert got == [("KDASelfAttention", "DenseMLP")] + [("KDASelfAttention", "LatentMoELayer")] * 2 + [
        ("GatedDSASelfAttention", "LatentMoELayer")
    ]


def test_rank_reads_only_its_own_experts(case, world2, world4):
    shards = sorted((case["root"] / "mixed").glob("*.safetensors"))
    assert len(shards) > 1, "premise: the checkpoint is sharded"
    ckpt = {}
    for f in shards:
        ckpt.update(load_file(str(f)))
    total = sum(v.numel() for k, v in ckpt.items() if ".experts." in k)
    for results, ep in ((world2[0], 1), (world2[0], 2), (world4[0], 4)):
        for rank, result in enumerate(results):
            got = result[f"mixed/ep{ep}"]
            assert got["read"]["expert_full_reads"] == 0, "expert stacks must be read through get_slice"
            assert got["read"]["expert_elements"] == total // ep, (rank, ep, got["read"], total)
            assert got["stats"]["expert_elements"] == total // ep


def test_state_dict_round_trip(case, world2):
    ckpt = {}
    for f in sorted((case["root"] / "mixed").glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    adapters = torch.load(case["root"] / "mixed" / "setup.pt")["adapters"]
    for result in world2[0]:
        got = result["mixed/ep2"]
        assert set(got["roundtrip"]) == set(ckpt)
        assert all(torch.equal(got["roundtrip"][k], v) for k, v in ckpt.items())
        assert set(got["adapter_roundtrip"]) == set(adapters)
        assert all(torch.equal(got["adapter_roundtrip"][k], v) for k, v in adapters.items())
        # After add_lora the base export still has the full stacked experts under the checkpoint's names.
        assert set(got["roundtrip_after_lora"]) == set(ckpt)
        assert all(torch.equal(got["roundtrip_after_lora"][k], v) for k, v in ckpt.items())


def test_packed_sequences_match_hf_cu_seqlens(case, world2):
    model = case["models"]["mixed"]
    for rank, result in enumerate(world2[0]):
        with torch.no_grad():
            want = model(input_ids=case["packed"][rank], cu_seqlens=PACKED_CU).logits
            unpacked = model(input_ids=case["packed"][rank]).logits
        got = result["mixed/ep2"]["packed_logits"]
        assert _rel(got, want) <= TOL, f"rank {rank}: packed logits rel err {_rel(got, want):.2e}"
        assert _rel(unpacked, want) > 1e-3, "premise: document boundaries must change the logits"


def test_load_errors_name_the_checkpoint_problem(world2):
    got = world2[0][0]["mixed/ep2"]["load_errors"]
    assert (
        got["missing"].startswith("checkpoint: 1 tensors of the model are missing")
        and "model.norm.weight" in got["missing"]
    ), got
    assert got["unexpected"].startswith("checkpoint: 1 tensors the model does not have"), got
    assert got["unexpected_not_strict"] is None, "strict=False must load past extra tensors"


def test_k3_checkpoint_loads_per_rank_reading_only_local_experts(case, world2):
    path = case["root"] / "k3"
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1, "premise: the K3 checkpoint is sharded"
    expert_sizes = {}
    for f in shards:
        with safe_open(str(f), framework="pt") as handle:
            expert_sizes.update((k, handle.get_slice(k).get_shape()) for k in handle.keys() if ".experts." in k)
    reference = load_k3_checkpoint(path)
    for rank, result in enumerate(world2[0]):
        got = result["k3/ep2"]
        with torch.no_grad():
            want = reference(input_ids=case["batches"][rank]).logits
        err = _rel(got["logits"], want)
        assert err <= TOL, f"rank {rank}: logits rel err {err:.2e} vs load_k3_checkpoint's model"
        first = 4 * rank
        assert set(got["local"].values()) == {(first, first + 4)}, got["local"]
        own = {k for k in expert_sizes if first <= int(k.split(".experts.")[1].split(".")[0]) < first + 4}
        assert len(own) == 3 * 3 * 4, "premise: 3 MoE layers x w1/w2/w3 x 4 local experts"
        assert got["read"]["expert_names"] == own, sorted(got["read"]["expert_names"] ^ own)[:4]
        elements = sum(torch.Size(expert_sizes[k]).numel() for k in own)
        assert got["read"]["expert_elements"] == elements == got["stats"]["expert_elements"]


def test_k3_load_lists_missing_and_unknown_tensors_in_one_error(world2):
    got = world2[0][0]["k3/ep2"]["broken_error"]
    assert got is not None and got.startswith("checkpoint: 1 tensors of the model are missing"), got
    assert "model.layers.2.block_sparse_moe.experts.5.w2.weight" in got, got
    assert "1 tensors the model does not have: ['model.layers.2.block_sparse_moe.experts.8.w1.weight']" in got, got
