"""MoE metrics (moe_plugin/training/metrics/moe.py): load summaries against hand-computed numbers, a key set
that does not grow with the experts, the per-EP-rank load and its capacity warning, the logged window of steps,
routing drift against an explicit recomputation of both routers from the router's recorded inputs, no extra
router call, indexer KL, the balance term; and the recipe trainer's W&B run and plot."""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from moe_plugin.training.metrics.logger import Distribution
from moe_plugin.training.metrics.moe import MoEMetrics, load_metrics, moe_layer_labels, rank_load_metrics, rank_loads
from tests.recipes import minimal, whole


def test_load_metrics_match_hand_computed_numbers():
    loads = torch.tensor([[2.0, 2.0, 0.0, 12.0], [5.0, 5.0, 5.0, 5.0]])
    got = load_metrics(loads, ["layer1", "layer3"])
    # layer1: mean 4, shares [0.5, 0.5, 0, 3]; population std of the shares sqrt(5.5 / 4)
    assert got["moe/layer1/load_max_over_mean"] == 3.0 and got["moe/layer1/load_min_over_mean"] == 0.0
    assert math.isclose(got["moe/layer1/load_cv"], math.sqrt(5.5 / 4), rel_tol=1e-12)
    assert got["moe/layer1/dead_experts"] == 1 and got["moe/layer1/overloaded_experts"] == 1
    assert got["moe/layer1/load"] == Distribution((0.5, 0.5, 0.0, 3.0))
    assert got["moe/layer3/load_cv"] == 0.0 and got["moe/layer3/dead_experts"] == 0
    assert got["moe/load_max_over_mean"] == 3.0 and got["moe/dead_experts"] == 1
    assert got["moe/overloaded_experts"] == 1


def test_load_keys_do_not_grow_with_the_experts():
    g = torch.Generator().manual_seed(0)
    few = load_metrics(torch.randint(0, 50, (3, 8), generator=g).float())
    many = load_metrics(torch.randint(0, 50, (3, 896), generator=g).float())
    assert set(few) == set(many) and len(few) == 3 * 6 + 3
    assert len(many["moe/moe0/load"].values) == 896


def test_load_metrics_refuse_bad_shapes():
    with pytest.raises(ValueError, match="loads: expected \\[num_moe_layers, num_experts\\]"):
        load_metrics(torch.ones(8))
    with pytest.raises(ValueError, match="labels: expected one per MoE layer \\(2\\)"):
        load_metrics(torch.ones(2, 8), ["layer1"])


def test_rank_load_is_the_busiest_ranks_copies_over_its_balanced_share():
    loads = torch.tensor([[2.0, 2.0, 0.0, 12.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    # EP 2: rank 0 holds experts 0-1, rank 1 experts 2-3; layer1's ranks take 4 and 12 copies of 16
    assert rank_loads(loads, 2).tolist() == [[0.5, 1.5], [1.0, 1.0], [0.0, 0.0]]
    got = rank_load_metrics(loads, 2, ["layer1", "layer2", "layer3"])
    assert got == {
        "moe/layer1/rank_load_max_over_mean": 1.5,
        "moe/layer2/rank_load_max_over_mean": 1.0,
        "moe/layer3/rank_load_max_over_mean": 0.0,
        "moe/rank_load_max_over_mean": 1.5,
    }
    assert rank_load_metrics(loads, 4)["moe/rank_load_max_over_mean"] == 3.0  # one expert per rank
    assert rank_load_metrics(loads, 1)["moe/rank_load_max_over_mean"] == 1.0
    with pytest.raises(ValueError, match="ep_size"):
        rank_loads(loads, 3)


class _TwoLayers(torch.nn.Module):
    """Two MoE layers of 4 experts (what MoEMetrics finds by class), no router adapter."""

    def __init__(self):
        super().__init__()
        from moe_plugin.config import MoEConfig
        from moe_plugin.layers.moe import StableLatentMoE

        config = MoEConfig(hidden_size=8, num_experts=4, top_k=2, expert_intermediate_size=8)
        self.layers = torch.nn.ModuleList(StableLatentMoE(config) for _ in range(2))


def test_logged_load_is_over_the_window_and_rank_load_its_worst_step():
    said = []
    metrics = MoEMetrics(_TwoLayers(), ep_size=2, capacity_factor=1.25, warn=said.append)
    assert metrics.labels == ["layer0", "layer1"]
    metrics.add_step(torch.tensor([[6.0, 0.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))  # layer0's rank 0: 6 of 8
    metrics.add_step(torch.tensor([[0.0, 1.0, 1.0, 6.0], [2.0, 2.0, 2.0, 2.0]]))  # its rank 1: 7 of 8
    got = metrics.collect()
    # the window's load: [6, 1, 2, 7] (max 7 / mean 4), and each rank's worst step: 6 / 4, 7 / 4
    assert got["moe/layer0/load_max_over_mean"] == 1.75 and got["moe/layer0/dead_experts"] == 0
    assert got["moe/layer0/rank_load_max_over_mean"] == 1.75 and got["moe/layer1/rank_load_max_over_mean"] == 1.0
    assert len(said) == 2 and "moe/layer0: expert-parallel rank 0 of 2 received 1.50x" in said[0]
    assert "rank 1 of 2 received 1.75x" in said[1] and "parallel.capacity_factor 1.25" in said[1]
    metrics.add_step(torch.tensor([[8.0, 8.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    got = metrics.collect()  # a new window; the same layer and rank past the factor again: no second warning
    assert got["moe/layer0/dead_experts"] == 2 and got["moe/layer0/rank_load_max_over_mean"] == 2.0
    assert len(said) == 2
    assert "moe/layer0/load_max_over_mean" not in metrics.collect()  # nothing since the last call


def test_balance_term_is_the_mean_over_the_micro_batches():
    metrics = MoEMetrics(_TwoLayers())
    metrics.add_loss_metrics({"aux_loss": torch.tensor([0.25, 0.5])})
    metrics.add_loss_metrics({"aux_loss": torch.tensor([0.75, 0.5])})
    got = metrics.collect()
    assert got == {"moe/layer0/aux_loss": 0.5, "moe/layer1/aux_loss": 0.5, "moe/aux_loss": 1.0}
    with pytest.raises(ValueError, match="aux_loss: expected one balance term per MoE layer \\(2\\)"):
        metrics.add_loss_metrics({"aux_loss": torch.tensor([0.25])})


def _lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    from moe_plugin import MoEPluginForCausalLM, preset_config

    torch.manual_seed(seed)
    model = MoEPluginForCausalLM(preset_config("tiny"))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2.0)  # a trained-looking adapter: it moves some choices
    return model


def test_routing_drift_equals_both_routers_recomputed_from_their_inputs():
    model = _lora_model()
    labelled = moe_layer_labels(model)
    assert [label for label, _ in labelled] == ["layer1", "layer2", "layer3"]
    inputs, calls = {}, {}
    handles = []
    for label, layer in labelled:
        handles.append(
            layer.gate.register_forward_pre_hook(
                lambda m, a, label=label: inputs.setdefault(label, []).append(a[0].detach().clone())
            )
        )
        handles.append(
            layer.gate.base_layer.register_forward_hook(
                lambda m, a, o, label=label: calls.__setitem__(label, calls.get(label, 0) + 1)
            )
        )
    metrics = MoEMetrics(model)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    got = metrics.collect(None)
    assert calls == {"layer1": 1, "layer2": 1, "layer3": 1}  # the hooks made no extra router call
    differ = total = 0
    for label, layer in labelled:
        (x,) = inputs[label]
        gate, k = layer.gate, layer.moe_config.top_k
        base_logits = x.float() @ gate.base_layer.weight.float().T
        lora = x.float() @ gate.lora_A["default"].weight.T @ gate.lora_B["default"].weight.T
        adapted_logits = base_logits + gate.scaling["default"] * lora
        bias = layer.router.e_score_correction_bias

        def chosen(logits, bias=bias, k=k):
            return torch.topk(torch.sigmoid(logits) + bias, k, dim=-1).indices

        a, b = chosen(adapted_logits), chosen(base_logits)
        moved = sum(len(set(r.tolist()) - set(s.tolist())) for r, s in zip(a, b))
        assert math.isclose(got[f"moe/{label}/routing_drift"], moved / a.numel(), abs_tol=1e-9)
        differ, total = differ + moved, total + a.numel()
    assert 0 < got["moe/routing_drift"] == pytest.approx(differ / total)
    with torch.no_grad():  # evaluation forwards are not training: nothing to report
        model(input_ids=ids)
    assert metrics.collect(None) == {}
    metrics.close()
    for h in handles:
        h.remove()


def test_indexer_kl_is_the_models_own_when_the_indexer_trains():
    from moe_plugin import MoEPluginForCausalLM, preset_config

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny")).train()
    metrics = MoEMetrics(model)
    assert metrics.drifting == []  # no adapter on the router: no drift to report
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    kls = [float(model(input_ids=ids, labels=ids).indexer_loss.detach()) for _ in range(2)]
    got = metrics.collect(None)
    assert got == {"moe/indexer_kl": pytest.approx(sum(kls) / 2, rel=1e-6)} and kls[0] > 0


def _recipe(tmp_path, name: str, experts: int, mode: str = "offline") -> dict:
    return minimal(
        tmp_path / name,
        seed=0,
        model=whole({"preset": "tiny", "overrides": {"num_experts": experts}}),
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "gate"]},
        data={"kind": "arithmetic", "operation": "-", "num_documents": 120, "seq_len": 64},
        parallel={"backend": "hf"},
        schedule={"steps": 3, "micro_batch_size": 2, "lr": 1e-2},
        logging={"every": 1, "wandb": {"mode": mode}},
    )


def test_recipe_trainer_writes_an_offline_wandb_run_and_the_load_plot(tmp_path):
    from matplotlib.image import imread

    from moe_plugin.training.loop import train
    from moe_plugin.recipe.schema import recipe_from_dict
    from tests.training.wandb_records import offline_history

    keys = {}
    for name, experts, mode in (("e8", 8, "offline"), ("e32", 32, "offline"), ("off", 8, "disabled")):
        result = train(recipe_from_dict(_recipe(tmp_path, name, experts, mode)))
        runs = glob.glob(os.path.join(result.output_dir, "wandb", "offline-run-*"))
        assert imread(os.path.join(result.output_dir, "expert_load.png")).shape[1] > 400
        if mode == "disabled":
            assert runs == [] and not os.path.exists(os.path.join(result.output_dir, "wandb"))
            continue
        (run,) = runs
        rows = offline_history(run)
        keys[experts] = {k for row in rows for k in row if not k.startswith("_")}
        logged = [row for row in rows if "train/loss" in row]
        assert [row["train/loss"] for row in logged] == pytest.approx(result.losses, rel=1e-6)
        assert [row["train/grad_norm"] for row in logged] == pytest.approx(result.grad_norms, rel=1e-6)
        histogram = logged[-1]["moe/layer2/load"]
        assert len(histogram["values"]) == 32 and sum(histogram["values"]) == experts
        assert any(row.get("moe/expert_load_plot", {}).get("_type") == "image-file" for row in rows)
    assert keys[8] == keys[32]
    assert {
        "moe/layer1/load",
        "moe/layer1/dead_experts",
        "moe/layer1/routing_drift",
        "moe/routing_drift",
        "train/tokens_per_s",
        "eval/loss",
        "moe/rank_load_max_over_mean",
        "moe/layer1/rank_load_max_over_mean",
        "moe/aux_loss",
        "moe/layer1/aux_loss",
    } <= keys[8]  # an adapter on gate: the balance term is on
