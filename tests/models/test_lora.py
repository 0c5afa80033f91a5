"""LoRA through plain peft: the seed's targets, every section-7 name, one adapter per routed expert (stacked),
merge_and_unload, saving and loading adapters, and a frozen base."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora.layer import ParamWrapper

import moe_plugin
from moe_plugin.layers.moe import MoERouter
from moe_plugin.layers.stacked_experts import StackedExperts
from moe_plugin.models import MoEPluginForCausalLM

SEED_TARGETS = ["q_proj", "k_proj", "gate"]
EXPERT_PARAMETERS = ["block_sparse_moe.experts.w1", "block_sparse_moe.experts.w2", "block_sparse_moe.experts.w3"]
# every nn.Linear name of docs/architecture.md 7 (KDA, MLA, indexer, MoE, dense MLP)
SECTION_7_LINEARS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate",
    "routed_expert_down_proj",
    "routed_expert_up_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]
RANK, ALPHA = 4, 8


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    # expert width 24 != latent 32, so a mix-up of the [E, out, in] axes cannot go unnoticed
    return MoEPluginForCausalLM(moe_plugin.preset_config("tiny", moe_intermediate_size=24)).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 384, (2, 40), generator=torch.Generator().manual_seed(1))


def adapt(base, modules, parameters=()):
    # init_lora_weights=False: B is random too, so the adapters change the outputs from the first step
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=modules,
        target_parameters=list(parameters) or None,
        init_lora_weights=False,
    )
    torch.manual_seed(5)
    return get_peft_model(copy.deepcopy(base), config).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def hand_merged(base, adapted):
    """The base with every adapted weight replaced by W + (alpha / r) B A, written out here: per expert e,
    A_e is rows [e r, (e+1) r) of the stacked lora_A and B_e is columns e, E + e, ... of lora_B
    (peft's stacking of one rank-r adapter per expert)."""
    merged = copy.deepcopy(base)
    scale = ALPHA / RANK
    plain = dict(merged.named_modules())
    for name, module in adapted.base_model.model.named_modules():
        if isinstance(module, ParamWrapper) and name.endswith(".base_layer"):
            continue  # nested inside another wrapper: handled with the outermost one
        while isinstance(module, ParamWrapper):
            experts = name.replace(".base_layer", "")
            weight = getattr(plain[experts], module.parameter_name)
            a = module.lora_A["default"].weight  # [E r, in]
            b = module.lora_B["default"].weight  # [out, r E]
            num_experts = weight.shape[0]
            with torch.no_grad():
                for e in range(num_experts):
                    a_e = a[e * RANK : (e + 1) * RANK]
                    b_e = b[:, e::num_experts]
                    weight[e] += scale * b_e @ a_e
            module, name = module.base_layer, name + ".base_layer"
        if isinstance(module, LoraLinear):
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            with torch.no_grad():
                plain[name].weight += scale * b @ a
    return merged


def test_seed_targets_wrap_kda_projections_and_router_only(base):
    model = adapt(base, SEED_TARGETS)
    wrapped = {name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "k_proj")}
    expected |= {f"model.layers.{i}.block_sparse_moe.gate" for i in (1, 2, 3)}
    assert wrapped == expected  # not gate_proj, not the MLA layer's projections
    assert isinstance(model.base_model.model.model.layers[1].block_sparse_moe.gate.base_layer, MoERouter)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_adapted_model_equals_hand_merged_weights(base, ids):
    model = adapt(base, SEED_TARGETS, EXPERT_PARAMETERS)
    wrappers, module = {}, model.base_model.model.model.layers[1].block_sparse_moe.experts
    while isinstance(module, ParamWrapper):  # peft nests one wrapper per targeted parameter
        wrappers[module.parameter_name], module = module, module.base_layer
    assert isinstance(module, StackedExperts) and sorted(wrappers) == ["w1", "w2", "w3"]
    # [E, out, in]: w1/w3 map latent 32 -> width 24, w2 width 24 -> latent 32; rank r per expert
    for name, (out_features, in_features) in {"w1": (24, 32), "w3": (24, 32), "w2": (32, 24)}.items():
        assert wrappers[name].num_experts == 8
        assert wrappers[name].lora_A["default"].weight.shape == (8 * RANK, in_features)
        assert wrappers[name].lora_B["default"].weight.shape == (out_features, 8 * RANK)
    adapted = logits(model, ids)
    assert rel(adapted, logits(base, ids)) > 1e-2  # the adapters do change the model
    assert rel(adapted, logits(hand_merged(base, model), ids)) < 1e-5


def test_merge_and_unload_equals_adapted(base, ids):
    model = adapt(base, SEED_TARGETS, EXPERT_PARAMETERS)
    adapted = logits(model, ids)
    merged = model.merge_and_unload()
    layer = merged.model.layers[1].block_sparse_moe
    assert type(layer.gate) is MoERouter and type(layer.experts) is StackedExperts
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert rel(logits(merged, ids), adapted) <= 1e-5


def test_adapters_save_and_load_with_plain_peft(base, ids, tmp_path):
    model = adapt(base, SEED_TARGETS, EXPERT_PARAMETERS)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    expert_adapters = [n for n in names if ".experts." in n and "layers.1." in n]
    assert len(expert_adapters) == 6  # lora_A and lora_B for each of w1, w2, w3: stacked, not one per expert
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize("names", [SECTION_7_LINEARS])
def test_every_section_7_name_can_be_targeted(base, ids, names):
    model = adapt(base, names)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert wrapped == set(names)
    adapted = logits(model, ids)
    assert rel(adapted, logits(hand_merged(base, model), ids)) < 1e-5
    assert rel(logits(model.merge_and_unload(), ids), adapted) <= 1e-5


def test_training_step_changes_only_adapters(base, ids):
    model = adapt(base, SEED_TARGETS, EXPERT_PARAMETERS).train()
    frozen = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert any("experts" in n for n in with_grad) and any(".gate.lora_" in n for n in with_grad)
    optimizer.step()
    for name, tensor in model.state_dict().items():
        if name in frozen:
            assert torch.equal(tensor, frozen[name]), name  # router weight and selection bias included
