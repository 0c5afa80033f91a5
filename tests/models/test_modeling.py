"""The Hugging Face models: Auto classes, sharded save/load, strict loading, fp32 islands in bf16, padding."""

import copy
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration
from moe_plugin.models.cache import HybridCache
from moe_plugin.models.presets import tiny


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return MoEPluginForCausalLM(moe_plugin.preset_config("tiny")).eval()


def _shards(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return set(json.load(f)["weight_map"].values())


def test_causal_lm_round_trip_through_auto_class_with_shards(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(_shards(tmp_path)) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MoEPluginForCausalLM
    ids = torch.randint(0, 384, (2, 40))
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # identical weights; the outputs agree to rounding (kernels may vectorise differently on other addresses)
    with torch.no_grad():
        assert rel(loaded(input_ids=ids).logits, tiny_model(input_ids=ids).logits) < 1e-6


def test_image_text_model_round_trip_through_auto_class(tmp_path):
    torch.manual_seed(1)
    model = MoEPluginForConditionalGeneration(moe_plugin.preset_config("tiny")).eval()
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(_shards(tmp_path)) > 1
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert type(loaded) is MoEPluginForConditionalGeneration
    # AutoModelForCausalLM (what peft's AutoPeftModelForCausalLM uses) reads the saved `architectures` and builds
    # the image+text model whole, as it does for a text checkpoint of the same config with the text model
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is MoEPluginForConditionalGeneration
    image_id = model.config.image_token_id
    ids = torch.tensor([[1, 2] + [image_id] * 6 + [3, 4]])
    patches, grid = torch.randn(24, 3 * 14 * 14), torch.tensor([[4, 6]])
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with torch.no_grad():
        ours = model(input_ids=ids, pixel_patches=patches, grid_hw=grid).logits
        assert rel(loaded(input_ids=ids, pixel_patches=patches, grid_hw=grid).logits, ours) < 1e-6


def test_forward_returns_its_own_cache(tiny_model):
    ids = torch.randint(0, 384, (1, 9))
    with torch.no_grad():
        out = tiny_model(input_ids=ids, use_cache=True)
    assert isinstance(out.cache, HybridCache)
    assert out.cache.get_seq_length() == 9 and len(out.cache) == 4


def test_mismatched_checkpoint_names_the_tensors(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.block_sparse_moe\.gate\.weight \(checkpoint \(8, 64\), "
        r"model \(4, 64\)\)",
    ):
        MoEPluginForCausalLM.from_pretrained(tmp_path, num_experts=4, num_experts_per_token=2)
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.layers\.4\.input_layernorm\.weight"):
        MoEPluginForCausalLM.from_pretrained(tmp_path, num_hidden_layers=5, layer_types=None)
    with pytest.raises(
        ValueError,
        match=r"with other shapes: model\.layers\.0\.self_attn\.A_log "
        r"\(checkpoint \(2,\), model \(3,\)\)",
    ):
        MoEPluginForCausalLM.from_pretrained(
            tmp_path, linear_attn_config=dict(tiny_model.config.linear_attn_config, num_heads=3)
        )
    # strict=False keeps transformers' own behaviour: reinitialise what does not fit
    model = MoEPluginForCausalLM.from_pretrained(
        tmp_path, num_experts=4, num_experts_per_token=2, strict=False, ignore_mismatched_sizes=True
    )
    assert model.model.layers[1].block_sparse_moe.experts.w1.shape[0] == 4


def test_indexer_is_optional_when_loading(tmp_path):
    torch.manual_seed(2)
    MoEPluginForCausalLM(moe_plugin.preset_config("tiny", use_dsa_indexer=False)).save_pretrained(tmp_path)
    model = MoEPluginForCausalLM.from_pretrained(tmp_path, use_dsa_indexer=True)
    assert model.model.layers[3].self_attn.indexer is not None


FP32_NAMES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")


def _is_kept_fp32(name):
    return name.endswith(FP32_NAMES) and "gate_proj" not in name


def test_to_bf16_keeps_decay_and_router_in_exact_fp32(tiny_model):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    reference = dict(tiny_model.named_parameters()) | dict(tiny_model.named_buffers())
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    kept = [n for n in tensors if _is_kept_fp32(n)]
    assert len(kept) == 3 * 2 + 3 * 2  # A_log, dt_bias on 3 KDA layers; router weight and bias on 3 MoE layers
    for name, tensor in tensors.items():
        if _is_kept_fp32(name):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
        else:
            assert tensor.dtype == torch.bfloat16, name
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 384, (1, 16))).logits
    assert torch.isfinite(logits).all()


def test_from_pretrained_bf16_keeps_decay_and_router_in_fp32(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    model = MoEPluginForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    reference = tiny_model.state_dict()
    for name, tensor in model.state_dict().items():
        expected = torch.float32 if _is_kept_fp32(name) else torch.bfloat16
        assert tensor.dtype == expected, name
        if expected == torch.float32:
            assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_row_alone(tiny_model, side):
    lengths, width = [7, 40, 3, 33], 40  # 40 > the tiny chunk size of 32: several chunks per row
    ids = torch.randint(0, 384, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1 if side == "left" else 0
        if side == "right":
            mask[row, :n] = 1
    with torch.no_grad():
        batched = tiny_model(input_ids=ids, attention_mask=mask).logits
        for row in range(len(lengths)):
            real = mask[row].bool()
            alone = tiny_model(input_ids=ids[row, real].unsqueeze(0)).logits[0]
            assert rel(batched[row, real], alone) < 1e-5, (row, rel(batched[row, real], alone))


def test_padded_loss_ignores_padding(tiny_model):
    ids = torch.randint(0, 384, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with torch.no_grad():
        loss = tiny_model(input_ids=ids, attention_mask=mask, labels=ids).loss
        logits = [tiny_model(input_ids=ids[:1]).logits[0], tiny_model(input_ids=ids[1:, :12]).logits[0]]
    # a plain next-token cross entropy over the real tokens of both rows
    targets = [ids[0, 1:], ids[1, 1:12]]
    expected = torch.nn.functional.cross_entropy(torch.cat([logits[0][:-1], logits[1][:-1]]), torch.cat(targets))
    assert rel(loss, expected) < 1e-5


def test_padding_that_is_not_contiguous_is_refused(tiny_model):
    ids = torch.randint(0, 384, (1, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        tiny_model(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1, 0, 0]]))


def test_k3_format_through_the_package_exports(tiny_model, tmp_path):
    from moe_plugin.models import load_k3_checkpoint, save_k3_checkpoint

    save_k3_checkpoint(tiny_model, tmp_path, max_shard_size="100KB")
    loaded = load_k3_checkpoint(tmp_path, dtype=torch.bfloat16)
    reference = tiny_model.state_dict()
    for name, tensor in loaded.state_dict().items():
        if _is_kept_fp32(name):  # exact fp32 values after the model was cast to bf16 before loading
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].bfloat16()), name


@pytest.mark.parametrize("cls", [MoEPluginForCausalLM, MoEPluginForConditionalGeneration])
@pytest.mark.parametrize("tie", [True, False])
def test_tied_embeddings_follow_the_config_through_save_and_load(cls, tie, tmp_path):
    model = cls(moe_plugin.preset_config("tiny", tie_word_embeddings=tie))
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    model.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tie
    assert torch.equal(loaded.get_output_embeddings().weight, model.get_output_embeddings().weight)


def test_init_zeroes_only_the_attn_res_projections():
    """One-output Linears that are not AttnRes projections (one KDA head's b_proj, a one-head indexer's
    weights_proj) are drawn like every other Linear; the AttnRes projections start at zero."""
    torch.manual_seed(3)
    kda = dict(tiny()["linear_attn_config"], num_heads=1)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", linear_attn_config=kda, index_n_heads=1))
    layers = model.model.layers
    assert layers[0].self_attn.b_proj.out_features == 1 and layers[3].self_attn.indexer.weights_proj.out_features == 1
    for weight in (layers[0].self_attn.b_proj.weight, layers[3].self_attn.indexer.weights_proj.weight):
        assert abs(weight.std().item() - model.config.initializer_range) < 0.01
    projections = [p for n, p in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(projections) == 2 * 4 + 1
    assert all(torch.equal(p, torch.zeros_like(p)) for p in projections)


def _check_fresh_init(model):
    """Every tensor finite, and the layers' own tensors in the ranges their init draws from."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.isfinite(tensor).all(), name
    for layer in model.model.layers[:3]:
        attn = layer.self_attn
        decay = attn.A_log.exp()
        assert ((decay > 1.0) & (decay <= 16.0)).all() and decay.unique().numel() == decay.numel()
        dt = torch.nn.functional.softplus(attn.dt_bias)
        assert ((dt > 0.999e-3) & (dt < 1.001e-1)).all()
        bound = 1.0 / 2.0  # conv kernel 4
        assert (attn.q_conv1d.weight.abs() <= bound).all() and attn.q_conv1d.weight.std() > 0.1
    experts = model.model.layers[1].block_sparse_moe.experts
    assert (experts.w1.abs() <= 32**-0.5 + 1e-6).all() and experts.w1.std() > 0.05  # fan_in 32


def test_initialize_weights_after_materialising_from_meta():
    with torch.device("meta"):
        model = MoEPluginForConditionalGeneration(moe_plugin.preset_config("tiny"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.fill_(float("nan"))
    model.initialize_weights()
    _check_fresh_init(model.language_model)
    pos = model.vision_tower.pos_embed
    assert abs(pos.std().item() - 0.02) < 0.002
    assert torch.equal(
        model.language_model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias, torch.zeros(8)
    )


def test_missing_tensors_are_initialised_and_loaded_ones_kept(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    dropped = (
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.1.block_sparse_moe.experts.w1",
    )
    for name in dropped:
        del state[name]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = MoEPluginForCausalLM.from_pretrained(tmp_path, strict=False)
    _check_fresh_init(model)
    reference = tiny_model.state_dict()
    for name, tensor in model.state_dict().items():
        if name not in dropped:
            assert torch.equal(tensor, reference[name]), name  # loaded neighbours untouched by the init
    assert not torch.equal(model.model.layers[0].self_attn.A_log, tiny_model.model.layers[0].self_attn.A_log)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(input_ids=torch.randint(0, 384, (5,))), r"^input_ids: expected 2 dimensions"),
        (dict(input_ids=torch.tensor([[1, 2, 384]])), r"^input_ids: expected token ids in \[0, 384\)"),
        (dict(input_ids=torch.tensor([[1, -1, 3]])), r"^input_ids: expected token ids in \[0, 384\)"),
        (dict(input_ids=torch.ones(1, 3)), r"^input_ids: expected an int32/int64 tensor"),
        (dict(inputs_embeds=torch.randn(1, 3, 32)), r"^inputs_embeds: expected shape"),
        (
            dict(input_ids=torch.ones(2, 6, dtype=torch.long), attention_mask=torch.ones(2, 5)),
            r"^attention_mask: expected shape \[2, 6\]",
        ),
        (
            dict(input_ids=torch.ones(2, 6, dtype=torch.long), labels=torch.ones(2, 5, dtype=torch.long)),
            r"^labels: expected shape \[2, 6\]",
        ),
        (
            dict(input_ids=torch.ones(2, 6, dtype=torch.long), labels=torch.full((2, 6), 384)),
            r"^labels: expected token ids \(or -100 to ignore\) in \[0, 384\)",
        ),
        (
            dict(
                input_ids=torch.ones(2, 6, dtype=torch.long),
                labels=torch.ones(2, 6, dtype=torch.long),
                logits_to_keep=1,
            ),
            r"^logits_to_keep: the loss needs the logits of every position",
        ),
    ],
)
def test_bad_inputs_name_the_argument(tiny_model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_model(**kwargs)


def test_bad_inputs_to_the_image_text_model_name_the_argument():
    model = MoEPluginForConditionalGeneration(moe_plugin.preset_config("tiny"))
    with pytest.raises(ValueError, match=r"^input_ids: expected token ids in \[0, 384\)"):
        model(input_ids=torch.tensor([[1, 400]]))
    with pytest.raises(ValueError, match=r"^labels: expected shape \[1, 2\]"):
        model(input_ids=torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2, 3]]))


def test_labels_with_ignored_positions_are_accepted(tiny_model):
    ids = torch.randint(0, 384, (1, 8))
    labels = ids.masked_fill(torch.arange(8) < 3, -100)
    with torch.no_grad():
        loss = tiny_model(input_ids=ids, labels=labels).loss
        logits = tiny_model(input_ids=ids).logits[0]
    expected = torch.nn.functional.cross_entropy(logits[2:-1], ids[0, 3:])
    assert rel(loss, expected) < 1e-5


def test_indexer_loss_enters_training_only_while_the_indexer_can_learn():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", vision_config=None, image_token_id=None))
    ids = torch.randint(0, 272, (1, 96))  # longer than index_topk (64): the selection matters
    model.train()
    out = model(input_ids=ids, labels=ids)
    lm_only = out.loss - model.config.indexer_loss_coeff * out.indexer_loss
    out.loss.backward()
    indexer_grads = [p.grad for p in model.indexer_parameters()]
    assert indexer_grads and all(g is not None and g.abs().sum() > 0 for g in indexer_grads)
    assert out.indexer_loss > 0 and lm_only < out.loss
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    lora.train()
    out = lora(input_ids=ids, labels=ids)
    assert out.indexer_loss is None  # frozen indexer: no dense KL target is computed
