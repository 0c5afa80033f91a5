"""Image+text training through the product's Trainer: the megatron image model (``MultimodalGPTModel``, Attention
Residuals on) at EP=1 in one process and at EP=2 x ZeRO-3 on 4 gloo processes equals the Hugging Face image model
(``MoEPluginForConditionalGeneration``) on the same batch: logits, and every step's loss, gradient norm,
adapter gradients and adapter, within the fp32 bounds of tests/tolerances.py, with LoRA on the vision tower and
projector as well as the text model; so does the Hugging Face backend at ZeRO-3 x 4. One of the four rows holds
no image, so one rank encodes only the blank image (docs/multimodal.md 3) while its peers encode theirs.
Rank code: tests/training/multimodal_workers.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_plugin.models.modeling_vl import MoEPluginForConditionalGeneration
from moe_plugin.models.presets import preset_config
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.testing.launch import run_distributed
from examples.shapes import write_shapes_dataset
from tests.recipes import recipe, whole
from tests.tolerances import chain_length, chain_rel, check_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test here starts processes; shared runs of minutes

WORKER = "tests/training/multimodal_workers.py:run_recipes"
SEQ = 128
LR = 2e-2
MAX_NORM = 1.0
TOKENS = 4 * SEQ  # a step's global batch: 4 rows, at most that many label tokens
TEXT_LAYERS, VISION_LAYERS, WIDTH = 4, 2, 128  # the tiny preset: the widest of hidden, MLP and sequence is 128
CHAIN = chain_length(TOKENS, layers=TEXT_LAYERS + VISION_LAYERS, width=WIDTH, vocab=384)
# one forward pass, reordered: the text layers and the tower's, over the widest contraction
LOGITS_REL = chain_rel(chain_length(0, TEXT_LAYERS + VISION_LAYERS, WIDTH, 0))
TEXT_ONLY = {
    "messages": [
        {"role": "user", "content": "Say the alphabet twice, please."},
        {"role": "assistant", "content": "abcdefghijklmnopqrstuvwxyz abcdefghijklmnopqrstuvwxyz"},
    ]
}


def _base(path, **overrides):
    """The tiny image model with routing far from ties (no flips from rounding differences between faces);
    ``overrides``: the preset's keys changed."""
    torch.manual_seed(0)
    model = MoEPluginForConditionalGeneration(preset_config("tiny", **overrides))  # Attention Residuals on, as K3
    with torch.no_grad():
        for layer in model.language_model.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.gate.weight.normal_(0.0, 0.3)
                layer.block_sparse_moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(path)
    ByteTokenizer().save_pretrained(path)  # a base brings its tokenizer (the preset's ids are the byte tokenizer's)


def _data(tmp):
    """Six shape questions (two per row) and one long text-only chat (a row alone): four rows in all."""
    path = write_shapes_dataset(str(tmp), 6, seed=4)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(TEXT_ONLY) + "\n")
    return path


def _recipe(tmp, name, base, data, backend, world, ep, checkpointing="off"):
    return recipe(
        tmp / name,
        world=world,
        ep=ep,
        base=base,
        lora={"target_modules": ["q_proj", "k_proj", "gate", "qkv", "linear_1"]},
        data=whole({"kind": "sft", "path": data, "seq_len": SEQ, "eval_fraction": 0.0}),
        parallel={"backend": backend},
        schedule={"lr": LR, "clip_grad_norm": MAX_NORM, "activation_checkpointing": checkpointing},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multimodal_trainer")
    base = tmp / "base"
    _base(base)
    data = _data(tmp)
    # activation checkpointing: each run again with "selective" and "full" (compared with these in test_recompute_*)
    layouts = {"hf": ("hf", 1, 1), "mg1": ("megatron", 1, 1), "mg4": ("megatron", 4, 2), "hf4": ("hf", 4, 1)}
    names = {
        world: [f"{n}{s}" for n, layout in layouts.items() if layout[1] == world for s in ("", "-selective", "-full")]
        for world in (1, 4)
    }

    def recipes(world):
        return [
            _recipe(
                tmp,
                name,
                base,
                data,
                *layouts[name.split("-")[0]],
                checkpointing=name.split("-")[1] if "-" in name else "off",
            )
            for name in names[world]
        ]

    one = run_distributed(WORKER, world_size=1, timeout_s=900, recipes=recipes(1))[0]
    four = run_distributed(WORKER, world_size=4, timeout_s=1500, recipes=recipes(4))
    by_name = dict(zip(names[1], one))
    by_name.update({name: [r[i] for r in four] for i, name in enumerate(names[4])})
    return by_name["hf"], by_name["mg1"], by_name["mg4"], by_name["hf4"], by_name


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = LOGITS_REL) -> bool:
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


def _hf_names(state: dict) -> dict:
    """The image model's PEFT names with the text model's ``language_model.`` prefix dropped, so that every run is
    compared under one naming (both backends' adapters carry the prefix; this only normalises them)."""
    return {k.replace("base_model.model.language_model.", "base_model.model."): v for k, v in state.items()}


def _named(run: dict) -> dict:
    """What check_run reads of a run, under one naming."""
    return {
        "losses": run["losses"],
        "grad_norms": run["grad_norms"],
        "step_grads": [_hf_names(g) for g in run["step_grads"]],
        "adapters": [_hf_names(a) for a in run["adapters"]],
    }


def _check_against(ref, got, rank=None):
    assert len(got["losses"]) == len(ref["losses"]) == 2
    ref_grads = _hf_names(ref["grads"])
    vision = [n for n in ref_grads if "vision_tower" in n or "mm_projector" in n]
    assert vision and all(float(ref_grads[n].abs().max()) > 0 for n in vision if "lora_B" in n), (
        "premise: the vision tower's and projector's adapters learn"
    )
    failures = check_run(_named(ref), _named(got), tokens=TOKENS, chain=CHAIN, lr=LR, max_norm=MAX_NORM)
    assert not failures, (rank, failures[:8])


def test_backends_build_the_image_models(runs):
    hf, mg1, mg4, hf4, _ = runs
    assert hf["model"] == "ImageTextTrainingModel" and mg1["model"] == "MultimodalGPTModel"
    assert {r["model"] for r in mg4} == {"MultimodalGPTModel"} and {r["model"] for r in hf4} == {hf["model"]}


def test_megatron_ep1_equals_the_hugging_face_image_model(runs):
    hf, mg1, _, _, _ = runs
    assert torch.equal(mg1["input_ids"], hf["input_ids"]) and hf["has_images"]
    assert _close(mg1["logits"], hf["logits"])
    _check_against(hf, mg1)


def test_megatron_ep2_zero3_on_4_processes_equals_the_hugging_face_image_model(runs):
    hf, _, mg4, _, _ = runs
    assert sorted(r["has_images"] for r in mg4) == [False, True, True, True]  # one rank encodes a blank only
    ids = torch.cat([r["input_ids"] for r in mg4], dim=1)
    assert torch.equal(ids, hf["input_ids"])
    assert _close(torch.cat([r["logits"] for r in mg4], dim=1), hf["logits"])
    for rank, got in enumerate(mg4):
        _check_against(hf, got, rank)


def test_hf_backend_zero3_on_4_processes_equals_one_process(runs):
    hf, _, _, hf4, _ = runs
    assert sorted(r["has_images"] for r in hf4) == [False, True, True, True]
    assert _close(torch.cat([r["logits"] for r in hf4], dim=1), hf["logits"])
    for rank, got in enumerate(hf4):
        _check_against(hf, got, rank)


def _same_run(off: dict, got: dict, where: str) -> None:
    """Bitwise: every step's loss, gradient norm, reduced adapter gradient and expert load, and the adapters."""
    assert got["losses"] == off["losses"] and got["grad_norms"] == off["grad_norms"], where
    for step, (g, o) in enumerate(zip(got["step_grads"], off["step_grads"])):
        assert sorted(g) == sorted(o) and all(torch.equal(g[n], o[n]) for n in o), (where, step)
    for step, (g, o) in enumerate(zip(got["loads"], off["loads"])):
        assert g is not None and torch.equal(g, o), (where, step)  # the expert-load metrics' counts
    assert all(torch.equal(got["adapter"][n], v) for n, v in off["adapter"].items()), where


@pytest.mark.parametrize("layout", ["hf", "mg1", "mg4", "hf4"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_equal_off_bitwise_with_the_router_once_per_step(runs, layout, mode):
    """schedule.activation_checkpointing (moe_plugin/layers/recompute.py) on the image+text base with Attention
    Residuals, the vision tower's adapters learning (so it recomputes too): one process, megatron EP=2 x ZeRO-3
    and the Hugging Face backend at ZeRO-3 x 4 all equal their "off" run bitwise (the CPU recompute is
    deterministic and the graph is the forward's), and every router ran once per layer per step."""
    by_name = runs[4]
    off, got = by_name[layout], by_name[f"{layout}-{mode}"]
    for rank, (o, g) in enumerate(zip(*(r if isinstance(r, list) else [r] for r in (off, got)))):
        _same_run(o, g, (layout, mode, rank))
        layers = len(g["router_calls"][0])
        assert layers == 3 and g["router_calls"] == o["router_calls"] == [[1] * layers] * 2, g["router_calls"]
