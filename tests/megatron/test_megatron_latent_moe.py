"""LatentMoELayer (Stable Latent MoE on megatron's MoELayer and alltoall dispatcher) at EP=2 vs one device.

The reference is the single-device StableLatentMoE with the same global weights, run here on each rank's
tokens. The ranks spy on moe_plugin.megatron.expert_dispatch._all_to_all to record what crosses the all-to-all.
"""

import pytest
import torch

from moe_plugin.config import MoEConfig
from moe_plugin.layers.moe import StableLatentMoE

TOL = 1e-5
EXPERT_KEYS = ("experts.w1", "experts.w2", "experts.w3")


def reference(ranks):
    """StableLatentMoE outputs and parameter gradients per rank; expert gradients also summed over ranks."""
    layer = StableLatentMoE(MoEConfig(**ranks[0]["moe"]))
    layer.load_state_dict(ranks[0]["global_state"])
    per_rank, expert_sum = [], {k: 0 for k in EXPERT_KEYS}
    for r in ranks:
        layer.zero_grad(set_to_none=True)
        x = r["x"].clone().requires_grad_(True)
        y, _ = layer(x)
        (y * r["grad_out"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        per_rank.append({"y": y.detach(), "x_grad": x.grad, "grads": grads})
        for k in EXPERT_KEYS:
            expert_sum[k] = expert_sum[k] + grads[k]
    return per_rank, expert_sum


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["mixed", "starved"])
def test_latent_ep2_matches_single_device(ep_check, rel_err, scenario):
    ranks = ep_check(f"latent/{scenario}")
    ref, expert_sum = reference(ranks)
    for rank, (got, want) in enumerate(zip(ranks, ref)):
        for key in ("y", "x_grad"):
            err = rel_err(got[key], want[key])
            assert err < TOL, f"rank {rank} {key}: rel err {err:.2e} vs StableLatentMoE"
        assert set(got["grads"]) == set(want["grads"]), "parameter names must be StableLatentMoE's"
        local = got["local"]
        for name, grad in got["grads"].items():
            # Expert weights see every rank's tokens; the rest only this rank's (no data-parallel reduction here).
            expected = expert_sum[name][local[0] : local[-1] + 1] if name in EXPERT_KEYS else want["grads"][name]
            err = rel_err(grad, expected)
            assert err < TOL, f"rank {rank} grad of {name}: rel err {err:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["mixed", "starved"])
def test_dispatcher_moves_latent_width_tokens(ep_check, scenario):
    for rank, got in enumerate(ep_check(f"latent/{scenario}")):
        n_tokens = got["x"].shape[0] * got["x"].shape[1]
        want = (n_tokens * got["moe"]["top_k"], got["moe"]["latent_size"])
        assert got["moe"]["latent_size"] < got["moe"]["hidden_size"] and got["dispatched_shapes"] == [want], (
            f"rank {rank}: token_dispatch should see one [tokens x top_k, latent] tensor, "
            f"saw {got['dispatched_shapes']}"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["mixed", "starved"])
def test_one_host_read_a_layer_at_ep2(ep_check, scenario):
    """Forward and backward of one layer at EP 2 read the device once: both split lists of the exchange in one
    ``tolist`` (moe_plugin/megatron/expert_dispatch.py); the backward's all-to-all reuses them."""
    for rank, got in enumerate(ep_check(f"latent/{scenario}")):
        assert got["host_reads"] == {("moe", "tolist"): 1}, f"rank {rank}: host reads {got['host_reads']}"


@pytest.mark.distributed
def test_starved_latent_expert(ep_check):
    ranks = ep_check("latent/starved")
    load = sum(r["load"] for r in ranks)
    copies = sum(r["moe"]["top_k"] * r["x"].shape[0] * r["x"].shape[1] for r in ranks)
    assert load[3] == 0 and load.sum() == copies, f"scenario premise broken: load {load.tolist()}"
    assert ranks[1]["received"][0].tolist() == [int(load[2]), 0], "EP rank 1's expert 3 must receive no tokens"


@pytest.mark.distributed
def test_state_dict_names_match_single_device_layer(ep_check):
    got = ep_check("latent/mixed")[0]
    assert got["state_keys"] == sorted(got["global_state"]), "LatentMoELayer must keep StableLatentMoE's names"


@pytest.mark.distributed
def test_latent_moe_spec_in_megatron_gpt_model(ep_check):
    for rank, got in enumerate(ep_check("gpt/latent")):
        assert got["mlp_types"] == ["LatentMoELayer"] * 2 and all(got["is_moe_layer"]), got["mlp_types"]
        assert torch.isfinite(torch.tensor(got["loss"])), f"rank {rank}: loss {got['loss']}"
        assert got["widths"] == [got["moe"]["latent_size"]] * 2, f"rank {rank}: dispatched widths {got['widths']}"
        assert got["no_grad"] == [], f"rank {rank}: parameters without gradient: {got['no_grad']}"


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_moe_experts", 8),
        ("moe_router_topk", 3),
        ("moe_shared_expert_intermediate_size", None),
        ("moe_token_dispatcher_type", "allgather"),
        ("hidden_size", 32),
        ("moe_latent_size", 8),
    ],
)
def test_config_mismatch_names_the_field(field, value):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.megatron.latent_moe import check_megatron_config, megatron_moe_fields

    moe = MoEConfig(hidden_size=16, num_experts=4, top_k=2, expert_intermediate_size=12, latent_size=8)
    fields = dict(num_layers=1, hidden_size=moe.hidden_size, num_attention_heads=2, **megatron_moe_fields(moe))
    check_megatron_config(TransformerConfig(**fields), moe)  # the fields it hands out are accepted
    fields[field] = value
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}"):
        check_megatron_config(TransformerConfig(**fields), moe)


@pytest.mark.distributed
def test_experts_start_equal_to_the_ep1_slice_and_distinct(ep_check):
    ranks = ep_check("latent/init")
    for rank, got in enumerate(ranks):
        local = got["ep"]["local"]
        assert got["ep1"]["local"] == [0, 1, 2, 3] and local == [2 * rank, 2 * rank + 1]
        for k in ("w1", "w2", "w3"):
            assert torch.equal(got["ep"][k], got["ep1"][k][local[0] : local[-1] + 1]), (
                f"rank {rank} {k}: EP=2 experts must equal experts {local} of the EP=1 layer"
            )
            full = got["ep1"][k]
            for i in range(full.shape[0]):
                for j in range(i):
                    assert rel_err_plain(full[i], full[j]) > 0.5, f"{k}: experts {i} and {j} start alike"
        assert all(dt == torch.float32 for dt in got["ep"]["dtypes"].values())
        bf16 = got["bf16"]["dtypes"]
        assert bf16["gate.weight"] == torch.float32, "the router stays fp32"
        assert all(dt == torch.bfloat16 for n, dt in bf16.items() if n != "gate.weight"), bf16
    assert not torch.equal(ranks[0]["ep"]["w1"], ranks[1]["ep"]["w1"]), "EP ranks hold different experts"


def rel_err_plain(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def loop_load(x, mask, router, bias, top_k):
    """Per non-padded token (x ``[S, B, H]``, mask ``[B, S]`` True = padding): count its top-k experts."""
    load = torch.zeros(router.shape[0])
    for s in range(x.shape[0]):
        for b in range(x.shape[1]):
            if mask[b, s]:
                continue
            choice = torch.sigmoid(router @ x[s, b]) + bias
            for e in torch.topk(choice, top_k).indices.tolist():
                load[e] += 1
    return load


@pytest.mark.distributed
def test_latent_load_accumulates_skips_padding_and_balances_globally(ep_check):
    ranks = ep_check("latent/balance")
    total = 0
    for rank, got in enumerate(ranks):
        want = sum(
            loop_load(x, m, got["router"], got["bias_before"], got["top_k"])
            for x, m in zip(got["x"], got["padding_mask"])
        )
        assert torch.equal(got["local_load"], want), f"rank {rank}: load {got['local_load']} vs loop {want}"
        assert got["after_pop"] is None, "pop_load must reset the count"
        assert got["found"] == ["LatentMoELayer"]
        total = total + want
    padded = sum(int(m.sum()) for m in ranks[0]["padding_mask"])
    assert padded > 0 and total.sum() == ranks[0]["top_k"] * sum(
        x.shape[0] * x.shape[1] - int(m.sum()) for r in ranks for x, m in zip(r["x"], r["padding_mask"])
    )
    want_bias = ranks[0]["bias_before"] + ranks[0]["rate"] * torch.sign(total.mean() - total)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["global_load"], total), f"rank {rank}: the load must be summed over the ranks"
        assert rel_err_plain(got["bias_after"], want_bias) < 1e-6, f"rank {rank}: bias {got['bias_after']}"


@pytest.mark.parametrize(
    "field, value, instead",
    [
        ("moe_aux_loss_coeff", 0.01, "bias_update_rate"),
        ("moe_z_loss_coeff", 0.001, "z-loss"),
        ("moe_router_padding_for_quantization", True, "padding"),
        ("moe_router_padding_for_fp8", True, "padding"),
        ("moe_router_force_load_balancing", True, "e_score_correction_bias"),
        ("moe_router_num_groups", 2, "MoEConfig.num_groups"),
        ("moe_router_group_topk", 1, "MoEConfig.topk_groups"),
        ("moe_router_topk_scaling_factor", 2.0, "MoEConfig.routed_scaling_factor"),
        ("moe_router_enable_expert_bias", True, "e_score_correction_bias"),
        ("moe_input_jitter_eps", 0.01, "jitter"),
    ],
)
def test_unread_megatron_router_options_are_refused(field, value, instead):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.megatron.latent_moe import check_megatron_config, megatron_moe_fields

    moe = MoEConfig(hidden_size=16, num_experts=4, top_k=2, expert_intermediate_size=12, latent_size=8)
    fields = dict(num_layers=1, hidden_size=moe.hidden_size, num_attention_heads=2, **megatron_moe_fields(moe))
    config = TransformerConfig(**fields)
    setattr(config, field, value)  # after __post_init__: megatron's own cross-field checks are not under test
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}") as info:
        check_megatron_config(config, moe)
    assert instead in str(info.value)


@pytest.mark.distributed
def test_overlapped_dispatch_is_bitwise_the_sequential_one_at_ep2(ep_check):
    """parallel.moe_overlap_chunks 1, 2, 4 at EP 2: outputs, input and parameter gradients bit for bit equal, with
    recompute "off" and "full"; equal to one device; a chunk combined out of order and a buffer reused in flight
    are caught (moe_plugin.testing.expert_dispatch.overlap_parity)."""
    from moe_plugin.testing.expert_dispatch import overlap_failures

    ranks = ep_check("overlap")
    assert {r["ep"] for r in ranks} == {2}
    assert not overlap_failures(ranks), overlap_failures(ranks)
