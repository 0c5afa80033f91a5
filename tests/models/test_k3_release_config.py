"""The published K3 config.json read as it is (moe_plugin/models/k3_config.py): the real file, kept as data in
tests/fixtures/k3/config.json, at full size (config only, the model on meta) and shrunk by the tiny release
writer; every key written back; refusals by name. The numbers are checked against the release's tensor list
(tests/fixtures/k3/weight_families.tsv) through the writer's specs, which test_k3_release_writer.py checks
family by family."""

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

import moe_plugin  # noqa: F401  (registers the Auto classes)
from moe_plugin.models.configuration import MoEPluginConfig
from moe_plugin.models.k3_config import KimiK3Config, config_from_k3, config_to_k3
from moe_plugin.models.modeling_vl import MoEPluginForConditionalGeneration
from moe_plugin.recipe.resolved_model import base_hf_config, resolve_model
from moe_plugin.testing.k3_release import read_published_config, release_tensor_specs, write_k3_release
from moe_plugin.weights import detect_layout, load_state
from moe_plugin.fileio import safetensors_weight_map

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
TOKENIZER = os.path.join(FIXTURES, "k3_tokenizer")
# the release's MLA layers, 0-based (the header of weight_families.tsv; config.json lists them 1-based)
MLA_LAYERS = set(range(3, 92, 4)) | {92}


@pytest.fixture(scope="module")
def published():
    return read_published_config()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3") / "release"
    write_k3_release(path, seed=0, tokenizer_dir=TOKENIZER)
    return path


def _section(model_section_path, **overrides):
    return SimpleNamespace(from_pretrained=str(model_section_path), preset=None, overrides=overrides)


def test_published_config_reads_at_full_size(published):
    config = config_from_k3(published)  # no overrides
    assert isinstance(config, KimiK3Config)
    mc = config.to_model_config()
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers) == (163840, 7168, 93)
    assert {i for i, t in enumerate(mc.layer_types) if t == "mla"} == MLA_LAYERS
    assert (mc.kda.num_heads, mc.kda.head_dim, mc.kda.conv_size, mc.kda.gate_lower_bound) == (96, 128, 4, -5.0)
    assert (mc.mla.num_heads, mc.mla.q_lora_rank, mc.mla.kv_lora_rank, mc.mla.use_indexer) == (96, 1536, 512, False)
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.latent_size, mc.moe.expert_intermediate_size) == (
        896,
        16,
        3584,
        3072,
    )
    assert (mc.moe.num_shared_experts, mc.moe.expert_format, mc.first_k_dense) == (2, "mxfp4", 1)
    assert (mc.attn_res, mc.attn_res_block_size, mc.dense_intermediate_size) == (True, 12, 33792)
    v = mc.vision
    assert (v.num_layers, v.hidden_size, v.num_heads, v.qkv_hidden_size, v.intermediate_size) == (
        27,
        1024,
        12,
        1536,
        4096,
    )
    assert (v.patch_size, v.merge_size, v.max_grid, v.out_hidden_size) == (14, 2, 64, 7168)
    # the image token is media_placeholder_token_id; image_placeholder is the processor's string, kept
    assert config.image_token_id == config.media_placeholder_token_id == 163605
    assert config.image_placeholder == "<|kimi_image_placeholder|>"
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (163584, 163586, 163839)


def test_published_config_builds_the_release_on_meta(published):
    """The image+text model of the published config, on meta, has every tensor of the release under the
    release's name with the release's shape (routed experts stacked, A_log unpadded)."""
    with torch.device("meta"):
        model = MoEPluginForConditionalGeneration(config_from_k3(published))
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for spec in release_tensor_specs(published, layers=range(5)):  # dense, KDA and MLA layers: 0..4
        name, shape = spec.name, spec.shape
        if ".experts." in name:  # experts.{e}.w1.weight_packed -> experts.w1 [E, ...]
            head, _, rest = name.partition(".experts.")
            w, kind = rest.split(".")[1], rest.split(".")[2]
            name, shape = f"{head}.experts.{w}{'_scale' if kind == 'weight_scale' else ''}", (896, *shape)
        elif name.endswith(".A_log"):
            shape = (96,)  # the release pads 96 heads to 128 entries
        assert state.get(name) == shape, f"{spec.name}: model has {state.get(name)}, release {spec.shape}"
    layers = {n for n in state if n.startswith("language_model.model.layers.")}
    assert {int(n.split(".")[3]) for n in layers} == set(range(93))


def test_published_config_round_trips_every_key(published, tmp_path):
    """save_pretrained writes the published file back, every key and value; AutoConfig (with or without
    trust_remote_code: the release's remote code is not in the directory) and MoEPluginConfig read it back."""
    config_from_k3(published).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == published
    for kwargs in ({}, {"trust_remote_code": True}):
        again = AutoConfig.from_pretrained(tmp_path, **kwargs)
        assert type(again) is KimiK3Config and again.to_dict() == published
    assert type(MoEPluginConfig.from_pretrained(tmp_path)) is KimiK3Config
    assert config_to_k3(config_from_k3(published), multimodal=True) == published
    assert copy.deepcopy(config_from_k3(published)).to_dict() == published


def test_unknown_keys_are_kept_and_changes_written(published, tmp_path):
    k3 = copy.deepcopy(published)
    k3["a_future_key"] = {"nested": [1, 2]}
    k3["text_config"]["another_future_key"] = "kept"
    config = config_from_k3(k3, num_experts_per_token=8, use_dsa_indexer=True)
    assert config.num_experts_per_token == 8 and config.to_model_config().mla.use_indexer
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["a_future_key"] == {"nested": [1, 2]}
    assert saved["text_config"]["another_future_key"] == "kept"
    assert saved["text_config"]["num_experts_per_token"] == 8 and saved["text_config"]["use_dsa_indexer"] is True
    # everything else exactly as published
    for section in ("text_config", "vision_config"):
        for key, value in k3[section].items():
            if key not in ("num_experts_per_token",):
                assert saved[section][key] == value, f"{section}.{key}"
    again = AutoConfig.from_pretrained(tmp_path)
    assert again.num_experts_per_token == 8 and again.use_dsa_indexer is True


@pytest.mark.parametrize(
    "edit, key",
    [
        (
            lambda k: k["text_config"].update(moe_router_activation_func="softmax"),
            "text_config.moe_router_activation_func",
        ),
        (lambda k: k["text_config"]["linear_attn_config"].update(use_full_rank_gate=False), "use_full_rank_gate"),
        (lambda k: k["text_config"].pop("hidden_size"), "text_config.hidden_size"),
        (lambda k: k.update(media_placeholder_token_id=163840), "media_placeholder_token_id"),
        (lambda k: k.pop("media_placeholder_token_id"), "media_placeholder_token_id"),
        (lambda k: k["vision_config"].update(norm_type="layernorm"), "vision_config.norm_type"),
        (lambda k: k["vision_config"].update(vt_some_new_knob=1), "vision_config.vt_some_new_knob"),
    ],
)
def test_unsupported_values_are_refused_by_name(published, edit, key):
    k3 = copy.deepcopy(published)
    edit(k3)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_from_k3(k3)


def test_shrunk_release_config_agrees_and_runs(release):
    """The tiny release's config.json (the published one shrunk, every key kept) reads the same through
    AutoConfig and the trainer's reader, and its model builds and runs a forward."""
    written = json.loads((release / "config.json").read_text())
    auto = AutoConfig.from_pretrained(release)
    trainer = base_hf_config(_section(release))
    assert type(auto) is type(trainer) is KimiK3Config
    assert auto.to_dict() == trainer.to_dict() == written
    assert auto.to_model_config() == trainer.to_model_config()
    mc = trainer.to_model_config()
    assert mc.layer_types == ["kda", "kda", "kda", "mla"] and mc.first_k_dense == 1 and mc.attn_res
    assert mc.moe.expert_format == "mxfp4" and mc.vision.kind == "moonvit3d"
    # the whole base as the trainer resolves it (its remote-code tokenizer trusted) holds the same config
    resolved = resolve_model(SimpleNamespace(**vars(_section(release)), trust_remote_code=True))
    assert resolved.format == "k3" and resolved.hf_config.to_dict() == written
    assert resolved.model_config == mc and resolved.tokens.image_token_id == written["media_placeholder_token_id"]
    # the recipe's overrides apply on top, as AutoConfig's keyword arguments do
    assert base_hf_config(_section(release, use_dsa_indexer=True)).to_model_config().mla.use_indexer
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(auto)
    assert type(model) is MoEPluginForConditionalGeneration
    ids = torch.randint(0, written["text_config"]["vocab_size"], (2, 12))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 12, written["text_config"]["vocab_size"])
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    # an image through the shrunk vision_config: one <|media_pad|> (media_placeholder_token_id) per image in the
    # ids, a 4 x 4 patch grid is 2 x 2 merged tokens (the release's ceil(h/28) x ceil(w/28)), so 5 ids become 8
    image = torch.tensor([[1, 2, written["media_placeholder_token_id"], 3, 4]])
    grid = torch.tensor([[1, 4, 4]])  # K3's grid_thws: (t, h, w) in patches
    pixels = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seen = model(input_ids=image, pixel_values=pixels, grid_thws=grid).logits
        other = model(input_ids=image, pixel_values=-pixels, grid_thws=grid).logits
    assert seen.shape == (1, 8, written["text_config"]["vocab_size"]) and torch.isfinite(seen).all()
    assert not torch.allclose(seen[:, -1], other[:, -1])  # the text after the image sees it


def _key_paths(d, prefix=""):
    paths = set()
    for key, value in d.items():
        paths.add(prefix + key)
        if isinstance(value, dict):
            paths |= _key_paths(value, prefix + key + ".")
    return paths


def test_release_written_back_by_save_pretrained_reloads(release, tmp_path):
    """A model of the release saved by save_pretrained keeps the release's config (every key) over this
    project's tensor names; its layout is told by the tensors (stacked experts), so from_pretrained and the
    trainer's loader (weights.load_state) read it back equal."""
    model = AutoModelForImageTextToText.from_pretrained(release)
    model.save_pretrained(tmp_path)
    written = json.loads((release / "config.json").read_text())
    assert _key_paths(json.loads((tmp_path / "config.json").read_text())) >= _key_paths(written)
    assert detect_layout(str(release), safetensors_weight_map(release)) == "k3"
    assert detect_layout(str(tmp_path), safetensors_weight_map(tmp_path)) == "hf"
    ids = torch.randint(0, written["text_config"]["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert torch.equal(AutoModelForImageTextToText.from_pretrained(tmp_path)(input_ids=ids).logits, want)
        fresh = MoEPluginForConditionalGeneration(AutoConfig.from_pretrained(tmp_path)).to(model.dtype)
        load_state(fresh, str(tmp_path), names="hf", config=fresh.config.to_model_config())
        assert torch.equal(fresh.eval()(input_ids=ids).logits, want)
