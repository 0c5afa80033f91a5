"""A text-only LoRA run over an image+text base (the shipped ``recipes/bases/tiny-shapes``: vision tower and
projector) trains the text model on the base's text weights, and its exports are the image+text model the base
loads as, with the base's vision tower unchanged (docs/exports.md "A text run over an image base").

One short run (the product's ``train`` on one process, hf backend, 2 conversations without images, both in
every step) is exported ``merged-hf`` and ``peft`` with the command. Each export is reloaded with plain
transformers / peft (``trust_remote_code=False``; ``import moe_plugin`` registers the classes) and must give
the trained model's logits on a text prompt: the run's adapter on the base's language model through
``PeftModel``. The merged export's vision tensors must be the base's, bit for bit."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.recipes import minimal
from tests.tolerances import chain_length, chain_rel
from tests.training.launchers import REPO, launch

BASE = os.path.join(REPO, "recipes", "bases", "tiny-shapes")
RECORDS = [("What is 2 plus 3?", "5"), ("Which colour is the sky on a clear day?", "blue")]
PROMPT = [{"role": "user", "content": "What is 4 plus 4?"}]  # a text question the run never saw
STEPS, SEQ_LEN = 4, 64
# no adapter on the router: the trainer then adds no balance loss, and its loss is the language model's alone
TARGET_MODULES, TARGET_PARAMETERS = ["q_proj", "k_proj"], ["experts.w1", "experts.w2", "experts.w3"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The run directory and its exports (``{format: directory}``)."""
    from moe_plugin.cli import main

    tmp = tmp_path_factory.mktemp("text_over_image")
    data = tmp / "text.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in RECORDS
        )
    )
    # micro_batch_size 2 over 2 rows: every step holds both conversations, so step 1's loss is theirs whatever
    # the shuffle
    recipe = minimal(
        tmp / "run",
        base=BASE,
        seed=3,
        lora={"r": 4, "alpha": 8, "target_modules": TARGET_MODULES, "target_parameters": TARGET_PARAMETERS},
        data={"kind": "sft", "path": str(data), "seq_len": SEQ_LEN, "pack": False, "eval_fraction": 0.0},
        parallel={"backend": "hf"},
        schedule={"steps": STEPS, "micro_batch_size": 2, "lr": 1e-2, "decay": "constant"},
        logging={"every": 1},
    )
    (tmp / "recipe.json").write_text(json.dumps(recipe))
    printed = launch(
        [sys.executable, "-m", "moe_plugin.train", "--recipe", str(tmp / "recipe.json")],
        env_extra={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    # the run's last line names a load that works for this base (the image model's language model)
    assert (
        f"PeftModel.from_pretrained(MoEPluginForConditionalGeneration.from_pretrained({os.path.realpath(BASE)!r})"
        f".language_model, "
    ) in printed, printed[-2000:]
    exports = {}
    for to in ("merged-hf", "peft"):
        exports[to] = str(tmp / to)
        assert main(["export", "--run", str(tmp / "run"), "--to", to, exports[to]]) == 0
    return {"run": str(tmp / "run"), "exports": exports}


def _auto(path: str):
    import moe_plugin  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).float().eval()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


def _bound(config, tokens: int, vocab: int = 0) -> float:
    """fp32 rounding of one forward pass of the text layers, reordered (tests/tolerances.py)."""
    width = max(config.hidden_size, config.intermediate_size, SEQ_LEN)
    return chain_rel(chain_length(tokens, config.num_hidden_layers, width, vocab))


@pytest.mark.distributed
def test_the_run_trains_the_text_model_on_the_bases_text_weights(job):
    """The adapter is the text model's (no vision module, no ``language_model.``), and step 1's loss is the base
    language model's own loss on the two conversations: the trainer loaded the base's text weights."""
    from safetensors.torch import load_file

    from moe_plugin.training.data.chat import sft_examples
    from moe_plugin.recipe.schema import ModelSection
    from moe_plugin.recipe.resolved_model import resolve_model

    keys = list(load_file(os.path.join(job["run"], "adapter", "adapter_model.safetensors")))
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys), keys[:5]
    assert any(".experts." in k for k in keys)
    resolved = resolve_model(ModelSection.model_validate({"from_pretrained": BASE}))
    base = _auto(BASE)
    text = base.language_model
    total, count, length = 0.0, 0, 0
    with torch.no_grad():
        for example in sft_examples(
            os.path.join(os.path.dirname(job["run"]), "text.jsonl"),
            resolved.tokenizer,
            resolved.processor,
            resolved.tokens,
        ):
            ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
            n = int((labels[0, 1:] != -100).sum())  # the first position has no prediction
            total += float(text(input_ids=ids, labels=labels).loss) * n
            count, length = count + n, length + ids.shape[1]
    with open(os.path.join(job["run"], "losses.json")) as f:
        first = json.load(f)[0]
    # the token sum over the step (in another order), the softmax and the layers: fp32 rounding only
    assert abs(first - total / count) <= _bound(base.config, length, base.config.vocab_size) * (total / count), (
        first,
        total / count,
    )


@pytest.mark.distributed
def test_every_export_reloads_with_plain_transformers_to_the_trained_models_logits(job):
    import moe_plugin
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BASE, trust_remote_code=False)
    ids = torch.tensor(
        [
            tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        ]
    ).reshape(1, -1)
    base = _auto(BASE)
    assert isinstance(base, moe_plugin.MoEPluginForConditionalGeneration)  # the base loads with its tower
    bound = _bound(base.config, ids.shape[1])
    with torch.no_grad():
        untrained = base(input_ids=ids).logits.float()
        trained = (
            PeftModel.from_pretrained(_auto(BASE).language_model, os.path.join(job["run"], "adapter"))
            .eval()(input_ids=ids)
            .logits.float()
        )
    assert _relative(untrained, trained) > 20 * bound  # the adapter's effect is far beyond rounding
    merged = _auto(job["exports"]["merged-hf"])
    peft = AutoPeftModelForCausalLM.from_pretrained(job["exports"]["peft"], trust_remote_code=False).float().eval()
    for name, model in (("merged-hf", merged), ("peft", peft)):
        inner = getattr(model, "get_base_model", lambda m=model: m)()
        assert isinstance(inner, moe_plugin.MoEPluginForConditionalGeneration), name  # the tower came along
        with torch.no_grad():
            got = model(input_ids=ids).logits.float()
        assert _relative(got, trained) <= bound, (name, _relative(got, trained), bound)


@pytest.mark.distributed
def test_the_merged_export_keeps_the_bases_vision_tower_bit_for_bit(job):
    from moe_plugin.weights.names import VISION_PREFIXES
    from tests.export.saved_files import directory_tensors

    base = directory_tensors(BASE)
    written = directory_tensors(job["exports"]["merged-hf"])
    vision = sorted(n for n in base if n.startswith(VISION_PREFIXES))
    assert vision and sorted(n for n in written if n.startswith(VISION_PREFIXES)) == vision
    assert all(torch.equal(written[n], base[n]) for n in vision)


def test_a_text_run_whose_target_list_names_tower_modules_leaves_the_tower_unadapted():
    """``proj`` and ``fc1`` name no module of the text model a text run trains, but do name the tower's: the
    moved adapter's config excludes the tower, so plain peft puts no fresh adapter there."""
    from peft import get_peft_model

    from moe_plugin.export.targets import onto_image_model
    from moe_plugin.lora import lora_config
    from moe_plugin.models import MoEPluginConfig, MoEPluginForConditionalGeneration
    from moe_plugin.weights.names import TEXT_PREFIX

    config = MoEPluginConfig.from_pretrained(BASE)
    lora = lora_config(4, 8, ["q_proj", "proj", "fc1"])
    state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    moved, targets, moved_lora = onto_image_model(state, config, lora)
    assert list(moved) == ["base_model.model.language_model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert targets and all(n.startswith(TEXT_PREFIX) for n in targets)
    assert lora.exclude_modules is None  # the run's own config is left as it was
    with torch.device("meta"):
        model = get_peft_model(MoEPluginForConditionalGeneration(config), moved_lora)
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted and all(n.startswith("base_model.model." + TEXT_PREFIX) for n in adapted), sorted(adapted)[:5]
