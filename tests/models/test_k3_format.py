"""K3-format checkpoints: the test writes a tiny checkpoint in K3's published layout with its own writer
(names and shapes from docs/architecture.md 2.3 / 7, per-expert tensors, padded A_log, ``[C, 1, 4]`` convs), then
checks loading, logits, byte-identical saving and the errors."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
from moe_plugin.models.k3_format import (
    config_from_k3,
    config_to_k3,
    load_k3_checkpoint,
    save_k3_checkpoint,
    state_dict_from_k3,
    state_dict_to_k3,
)
from tests.models.k3_fixtures import (
    A_LOG_STORED,
    tiny,
    k3_text_config,
    k3_text_shapes,
    random_tensors,
    write_k3,
    direct_state_dict,
    rel_err,
    read_dir,
)


@pytest.mark.parametrize("attn_res", [True, False])
def test_load_logits_and_byte_identical_save(tmp_path, attn_res):
    k3 = k3_text_config(attn_res)
    written = random_tensors(k3_text_shapes(k3), num_heads=2)
    write_k3(tmp_path / "k3", k3, written)

    model = load_k3_checkpoint(tmp_path / "k3")
    # knobs of parts a K3 config switches off (indexer, AttnRes) keep the config defaults
    unused = {"index_topk": 2048} | ({} if attn_res else {"attn_res_block_size": 12})
    text_only = tiny(attn_res, vision_config=None, image_token_id=None, **unused)
    assert model.config.to_model_config() == text_only.to_model_config()

    # (a) every tensor landed in its parameter, and every model tensor came from the checkpoint
    expected = direct_state_dict(written, num_heads=2)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(loaded[name], t), name

    # (b) logits equal a model given the same weights by direct state_dict assignment
    reference = MoEPluginForCausalLM(text_only)
    reference.load_state_dict(expected, strict=True)
    reference.eval()
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert rel_err(got, want) < 1e-6

    # (c) saving writes back the same names, shapes, dtypes and bytes, sharded with an index
    files = save_k3_checkpoint(model, tmp_path / "out", max_shard_size=40_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    saved = read_dir(tmp_path / "out")
    assert sorted(saved) == sorted(written)
    for name, t in written.items():
        assert saved[name].dtype == t.dtype and saved[name].shape == t.shape, name
        assert torch.equal(saved[name], t), name
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)["weight_map"]
    assert sorted(index) == sorted(written)
    # and the written directory is itself a loadable K3 checkpoint
    again = load_k3_checkpoint(tmp_path / "out")
    with torch.no_grad():
        assert rel_err(again(ids).logits, want) < 1e-6


def test_single_file_and_a_log_with_singleton_dims(tmp_path):
    k3 = k3_text_config()
    written = random_tensors(k3_text_shapes(k3), num_heads=2)
    for name in [n for n in written if n.endswith(".A_log")]:
        padded = torch.randn(A_LOG_STORED)  # padding entries that are not zero must be ignored too
        padded[:2] = written[name][:2]
        written[name] = padded.reshape(1, 1, A_LOG_STORED, 1)
    os.makedirs(tmp_path / "k3")
    with open(tmp_path / "k3" / "config.json", "w") as f:
        json.dump(k3, f)
    save_file(written, str(tmp_path / "k3" / "model.safetensors"))
    model = load_k3_checkpoint(tmp_path / "k3")
    a_log = model.model.layers[0].self_attn.A_log
    assert torch.equal(a_log.detach().reshape(-1), written["model.layers.0.self_attn.A_log"].reshape(-1)[:2])
    files = save_k3_checkpoint(model, tmp_path / "out")
    assert files == ["config.json", "model.safetensors"]
    assert read_dir(tmp_path / "out")["model.layers.0.self_attn.A_log"].shape == (A_LOG_STORED,)


def test_multimodal_checkpoint(tmp_path):
    vl_config = tiny(index_topk=2048)
    vl = MoEPluginForConditionalGeneration(vl_config)
    text = k3_text_config()
    written = {"language_model." + n: t for n, t in random_tensors(k3_text_shapes(text), num_heads=2).items()}
    gen = torch.Generator().manual_seed(3)
    written.update(
        {
            n: torch.randn(t.shape, generator=gen)
            for n, t in vl.state_dict().items()
            if n.startswith(("vision_tower.", "mm_projector."))
        }
    )
    k3 = {
        "model_type": "kimi_k3",
        "text_config": text,
        "image_token_id": 259,
        "vision_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "patch_size": 14,
            "merge_kernel_size": [2, 2],
            "pos_emb_height": 16,
            "pos_emb_width": 16,
        },
    }
    write_k3(tmp_path / "k3", k3, written)

    model = load_k3_checkpoint(tmp_path / "k3", model_cls=MoEPluginForConditionalGeneration)
    assert model.config.to_model_config() == vl_config.to_model_config()
    expected = direct_state_dict(written, num_heads=2, prefix="language_model.")
    assert sorted(model.state_dict()) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(model.state_dict()[name], t), name

    save_k3_checkpoint(model, tmp_path / "out", max_shard_size=100_000)
    saved = read_dir(tmp_path / "out")
    assert sorted(saved) == sorted(written)
    assert all(torch.equal(saved[n], t) for n, t in written.items())
    with open(tmp_path / "out" / "config.json") as f:
        assert "text_config" in json.load(f)

    # the text model takes the text half: prefix stripped, vision tensors refused unless dropped
    with pytest.raises(ValueError, match=r"unknown tensor.*vision_tower\."):
        load_k3_checkpoint(tmp_path / "k3")
    text_model = load_k3_checkpoint(tmp_path / "k3", ignore_vision=True)
    text_expected = direct_state_dict({n: t for n, t in written.items() if n.startswith("language_model.")}, 2)
    for name, t in text_expected.items():
        assert torch.equal(text_model.state_dict()[name], t), name


def test_unknown_and_missing_tensors_in_one_error():
    k3 = k3_text_config()
    tensors = random_tensors(k3_text_shapes(k3), num_heads=2)
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(3)
    tensors["model.layers.1.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(32, 32)  # expert 8 of 8
    del tensors["model.norm.weight"], tensors["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(ValueError) as err:
        state_dict_from_k3(tensors, config_from_k3(k3))
    message = str(err.value)
    assert "2 unknown" in message and "2 missing" in message
    for name in (
        "model.layers.0.self_attn.bogus.weight",
        "model.layers.1.block_sparse_moe.experts.8.w1.weight",
        "model.norm.weight",
        "model.layers.2.block_sparse_moe.experts.3.w2.weight",
    ):
        assert name in message


def test_shape_mismatch_names_tensor_and_both_shapes():
    k3 = k3_text_config()
    tensors = random_tensors(k3_text_shapes(k3), num_heads=2)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(60, 64)
    tensors["model.layers.3.block_sparse_moe.experts.5.w2.weight"] = torch.zeros(32, 31)
    with pytest.raises(ValueError) as err:
        state_dict_from_k3(tensors, config_from_k3(k3))
    message = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight: checkpoint [60, 64], model [64, 64]" in message
    assert "model.layers.3.block_sparse_moe.experts.5.w2.weight: checkpoint [32, 31] float32, model [32, 32]" in message


@pytest.mark.parametrize("form", ["compressed_tensors", "blocks", "uint8"])
def test_mxfp4_tensors_are_refused(form):
    k3 = k3_text_config()
    tensors = random_tensors(k3_text_shapes(k3), num_heads=2)
    name = "model.layers.1.block_sparse_moe.experts.0.w1"
    del tensors[name + ".weight"]
    if form == "compressed_tensors":
        tensors[name + ".weight_packed"] = torch.zeros(32, 16, dtype=torch.uint8)
        tensors[name + ".weight_scale"] = torch.full((32, 1), 127, dtype=torch.uint8)
    elif form == "blocks":
        tensors[name + ".weight_blocks"] = torch.zeros(32, 1, 16, dtype=torch.uint8)
        tensors[name + ".weight_scales"] = torch.zeros(32, 1, dtype=torch.uint8)
    else:
        tensors[name + ".weight"] = torch.zeros(32, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="MXFP4-quantised tensors .* but the model.s experts are dense"):
        state_dict_from_k3(tensors, config_from_k3(k3))


def test_mtp_layers_are_unknown_unless_ignored():
    k3 = k3_text_config(num_nextn_predict_layers=1)
    tensors = random_tensors(k3_text_shapes(k3) | k3_text_shapes(dict(k3, num_hidden_layers=5), layers=[4]), 2)
    with pytest.raises(ValueError, match=r"model\.layers\.4\..*ignore_mtp=True"):
        state_dict_from_k3(tensors, config_from_k3(k3))
    state = state_dict_from_k3(tensors, config_from_k3(k3), ignore_mtp=True)
    assert not any(n.startswith("model.layers.4.") for n in state)


def test_indexer_starts_fresh_and_survives_a_round_trip(tmp_path):
    k3 = k3_text_config()
    written = random_tensors(k3_text_shapes(k3), num_heads=2)
    write_k3(tmp_path / "k3", k3, written)
    model = load_k3_checkpoint(tmp_path / "k3", use_dsa_indexer=True, index_topk=4)
    indexer = {n: t for n, t in model.state_dict().items() if ".self_attn.indexer." in n}
    assert indexer and all(torch.isfinite(t).all() for t in indexer.values())
    expected = direct_state_dict(written, num_heads=2)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in expected.items())

    save_k3_checkpoint(model, tmp_path / "out")
    again = load_k3_checkpoint(tmp_path / "out")
    assert again.config.use_dsa_indexer and again.config.index_topk == 4
    assert all(torch.equal(again.state_dict()[n], t) for n, t in indexer.items())


def test_state_dict_round_trip_in_memory():
    config = tiny(vision_config=None)
    model = MoEPluginForCausalLM(config)
    k3_tensors = state_dict_to_k3(model.state_dict(), config)
    assert k3_tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"].shape == (32, 32)
    assert torch.equal(
        k3_tensors["model.layers.1.block_sparse_moe.experts.5.w1.weight"],
        model.model.layers[1].block_sparse_moe.experts.w1[5],
    )
    back = state_dict_from_k3(k3_tensors, config)
    assert sorted(back) == sorted(model.state_dict())
    assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())


def test_config_keys():
    k3 = k3_text_config()
    config = config_from_k3(k3)
    assert config.to_model_config().layer_types == ["kda", "kda", "kda", "mla"]
    assert config.attn_res and not config.use_dsa_indexer
    assert config_from_k3(config_to_k3(config)).to_model_config() == config.to_model_config()
    assert not config_from_k3(k3_text_config(attn_res=False)).attn_res
    grouped = config_from_k3(dict(k3, use_grouped_topk=True, num_expert_group=2, topk_group=1))
    assert (grouped.num_expert_group, grouped.topk_group) == (2, 1)
    vl = moe_plugin.preset_config("tiny")  # with the indexer on
    assert config_from_k3(config_to_k3(vl, multimodal=True)).to_model_config() == vl.to_model_config()


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("mla_use_nope", False, "mla_use_nope"),
        ("hidden_act", "gelu", "hidden_act"),
        ("num_experts", None, "num_experts"),
        ("linear_attn_config", {"use_full_rank_gate": False}, "linear_attn_config.use_full_rank_gate"),
        ("linear_attn_config", {"full_attn_layers": [4, 5]}, "linear_attn_config.full_attn_layers"),
        ("linear_attn_config", {"kda_layers": [1, 2, 3, 4]}, "linear_attn_config.kda_layers"),
    ],
)
def test_unsupported_config_values_name_the_key(key, value, named):
    k3 = k3_text_config()
    if key == "linear_attn_config":
        value = dict(k3[key], **value)
    if value is None:
        del k3[key]
    else:
        k3[key] = value
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        config_from_k3(k3)
    with pytest.raises(ValueError, match="text_config." + named.replace(".", r"\.")):
        config_from_k3({"text_config": k3})


def test_load_in_bfloat16_keeps_the_router_fp32(tmp_path):
    k3 = k3_text_config()
    written = random_tensors(k3_text_shapes(k3), num_heads=2)
    write_k3(tmp_path / "k3", k3, written)
    model = load_k3_checkpoint(tmp_path / "k3", dtype=torch.bfloat16)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.bfloat16
    assert torch.equal(q_proj, written["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    router = model.model.layers[1].block_sparse_moe.gate.weight
    assert router.dtype == torch.float32 and torch.equal(router, written["model.layers.1.block_sparse_moe.gate.weight"])
