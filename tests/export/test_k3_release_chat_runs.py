"""Issue 34's end-to-end runs on the tiny Kimi K3 release (``moe_plugin.testing.k3_release``: the published
config.json shrunk, bf16 with the fp32 families, MXFP4 experts, the MoonViT-3D tower, the K3-style remote-code
tokenizer), with OpenAI-format chat records as a user writes them: tools given per record, an assistant's
reasoning_content, tool_call arguments both as a JSON string and as an object (and one not JSON at all), tool
results out of call order (matched by tool_call_id), a user message that types ``<|open|>`` and
``<|end_of_msg|>`` as text, and a picture as an ``image_url`` data URL.

- One process, both backends (hf and megatron, one launch): the rows of each run's first micro-batch are rows of
  ``moe-plugin data --dump``, whose rows are the tokenizer's own ``apply_chat_template(..., tokenize=True)``
  token for token (the picture's one ``<|media_pad|>`` expanded, never trained), with labels on exactly each
  assistant turn as the rendering writes it (tests/training/test_k3_chat_data.k3_reference_labels); both backends
  give the same losses.
- EP 2 x ZeRO-3 on 2 processes under the ``deepspeed`` launcher, as a user types it, gives the one-process run's
  losses (the same two rows a step), and its adapter on the vision tower and the experts trains; it is exported
  (peft, merged-k3; test_k3_release_run.py covers every format on a one-process run) and reloaded with plain
  transformers / peft (after ``import moe_plugin``). The reference is the run's own adapter through plain peft's
  ``PeftModel`` over the base loaded by the Auto class, its MXFP4 experts decoded to a dense twin by the
  published formula (plain peft cannot adapt packed experts, docs/exports.md "Packed bases"): the adapter moves
  the logits far from the base's; the peft export gives the adapter's logits; merged-k3's tensors are plain
  peft's own merge rounded once to bf16. Each export's ``AutoTokenizer(trust_remote_code=True)`` renders the
  records to the base's ids.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_plugin.models.base_tokenizer import k3_image_prompt
from moe_plugin.ops.quant.formats import decode_mxfp4_reference
from moe_plugin.testing.k3_release import write_k3_release
from moe_plugin.testing.launch import run_distributed
from tests.recipes import recipe, whole
from tests.training.launchers import BIN, REPO, free_port, launch
from tests.training.test_k3_chat_data import TOOL_CHAT, TOOLS, k3_reference_labels, k3_rendering

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOKENIZER = os.path.join(REPO, "tests", "fixtures", "k3_tokenizer")
WORKER = "tests/export/k3_chat_workers.py:train_recipes"
SEQ, STEPS, IGNORE = 1024, 3, -100
PICTURE = (40, 30)  # width, height
EXPORTS = ("peft", "merged-k3")


def _data_url() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", PICTURE, (255, 0, 0)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _records() -> list:
    picture = {"type": "image_url", "image_url": {"url": _data_url()}}
    return [
        {"messages": TOOL_CHAT, "tools": TOOLS},
        {
            "messages": [
                {"role": "user", "content": [picture, {"type": "text", "text": "What colour is it?"}]},
                {"role": "assistant", "content": "red", "reasoning_content": "It looks red."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "What is 2 plus 3? (I typed <|open|>)"},
                {"role": "assistant", "content": "5"},
            ]
        },
    ]


def _recipe(tmp, name, base, data, *, world=1):
    values = recipe(
        tmp / name,
        world=world,
        ep=world,
        batch=2,
        base=base,
        model={"trust_remote_code": True},
        lora={"target_modules": ["q_proj", "k_proj", "gate", "wqkv"]},
        data=whole({"kind": "sft", "path": str(data), "seq_len": SEQ, "pack": False, "eval_fraction": 0.0}),
        parallel={"backend": "hf" if name == "hf" else "megatron"},
        schedule={"steps": STEPS},
    )
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(values))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from moe_plugin.cli import main

    tmp = tmp_path_factory.mktemp("k3_release_chat_runs")
    base = tmp / "base"
    write_k3_release(base, tokenizer_dir=TOKENIZER)
    data = tmp / "chats.jsonl"
    records = _records()
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    recipes = {name: _recipe(tmp, name, base, data) for name in ("hf", "megatron")}
    recipes["ep2"] = _recipe(tmp, "ep2", base, data, world=2)
    dump = tmp / "dump.jsonl"
    assert main(["data", "--recipe", recipes["hf"], "--dump", str(dump)]) == 0
    one = run_distributed(WORKER, world_size=1, timeout_s=600, paths=[recipes["hf"], recipes["megatron"]])[0]
    printed = launch(
        [os.path.join(BIN, "deepspeed"), "--num_accelerators", "2", "--master_port", str(free_port())]
        + ["--module", "moe_plugin.train", "--recipe", recipes["ep2"]],
        env_extra={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    exports = {to: str(tmp / "exports" / to) for to in EXPORTS}
    for to, out in exports.items():
        assert main(["export", "--run", str(tmp / "ep2"), "--to", to, out]) == 0, to
    return {
        "base": str(base),
        "records": records,
        "data": str(data),
        "dump": [json.loads(line) for line in dump.read_text().splitlines()],
        "one": dict(zip(("hf", "megatron"), one)),
        "ep2": {"printed": printed, "run": str(tmp / "ep2")},
        "exports": exports,
    }


def _rendering(tokenizer, record) -> list:
    """The tokenizer's own ids of ``record`` (its tools; a picture as K3's processor hands it, by its size)."""
    pictures = sum(isinstance(m["content"], list) for m in record["messages"])
    kwargs = {"image_prompts": [k3_image_prompt(*PICTURE)] * pictures} if pictures else {}
    return k3_rendering(tokenizer, record["messages"], tools=record.get("tools"), **kwargs)


def _dense_twin(base: str, out) -> str:
    """``base`` with its MXFP4 experts decoded by the published formula (``decode_mxfp4_reference``, column by
    column) and stored dense in bf16 (exact: E2M1 times a power of two fits bf16), its quantization_config
    dropped: the base plain peft can adapt."""
    os.makedirs(out)
    tensors = {}
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if name.endswith(".safetensors"):
            tensors.update(load_file(path))
        elif os.path.isfile(path) and name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(path, out)
    dense = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            stem = name[: -len("_packed")]
            dense[stem] = decode_mxfp4_reference(t, tensors[stem + "_scale"], 2 * t.shape[-1]).bfloat16()
        elif not name.endswith(".weight_scale"):
            dense[name] = t
    save_file(dense, os.path.join(out, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    config["text_config"].pop("quantization_config")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out)


def test_the_dump_is_the_tokenizers_rendering_token_by_token(runs):
    from transformers import AutoTokenizer

    k3 = AutoTokenizer.from_pretrained(runs["base"], trust_remote_code=True)
    pad_id = k3.convert_tokens_to_ids("[PAD]")
    media_pad = k3.convert_tokens_to_ids("<|media_pad|>")
    seen = set()
    for row in runs["dump"]:
        (source,) = row["sources"]
        index = int(source.split()[1]) - 1
        seen.add(index)
        want = _rendering(k3, runs["records"][index])
        if media_pad in want:  # the one <|media_pad|> of the picture, expanded to its tokens
            n, at = row["input_ids"].count(media_pad), want.index(media_pad)
            assert n > 1, n
            want = want[:at] + [media_pad] * n + want[at + 1 :]
        ids, labels = row["input_ids"], row["labels"]
        assert len(want) <= SEQ and ids[: len(want)] == want, index
        assert set(ids[len(want) :]) <= {pad_id} and set(labels[len(want) :]) <= {IGNORE}
        assert labels[: len(want)] == k3_reference_labels(k3, want), index
    assert seen == {0, 1, 2}
    # the typed control-token text stayed text: the user's <|open|> is not the special id
    tool_row = next(r for r in runs["dump"] if r["sources"][0].startswith("line 1 "))
    text = k3.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=False)
    assert tool_row["input_ids"].count(k3.convert_tokens_to_ids("<|open|>")) == text.count("<|open|>") - 1


def test_one_process_runs_train_the_dumps_rows_alike_on_both_backends(runs):
    rows = {(tuple(r["input_ids"]), tuple(r["labels"])) for r in runs["dump"]}
    for name, result in runs["one"].items():
        assert len(result["input_ids"]) == 2, name
        for ids, labels in zip(result["input_ids"], result["labels"]):
            assert (tuple(ids), tuple(labels)) in rows, name
    hf, mg = runs["one"]["hf"]["losses"], runs["one"]["megatron"]["losses"]
    assert len(hf) == len(mg) == STEPS and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(hf, mg)), (hf, mg)


def test_ep2_zero3_under_the_deepspeed_launcher_trains_as_one_process(runs):
    assert "expert parallel 2, ZeRO stage 3" in runs["ep2"]["printed"]
    with open(os.path.join(runs["ep2"]["run"], "losses.json")) as f:
        losses = json.load(f)
    one = runs["one"]["megatron"]["losses"]
    # the same two rows a step (one a rank): the same losses, to the reduction order's rounding
    assert len(losses) == STEPS and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, one)), (losses, one)


@pytest.fixture(scope="module")
def reloaded(runs, tmp_path_factory):
    """Plain transformers / peft loads (fp32): the logits on the tool conversation's first 256 ids of the base,
    the run's adapter, the peft export and merged-k3; the parameters of merged-k3 (in its stored dtypes) and of
    plain peft's own ``merge_and_unload`` of the run's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    import moe_plugin  # noqa: F401  (registers the Auto classes)

    twin = _dense_twin(runs["base"], tmp_path_factory.mktemp("k3_dense_twin") / "base")
    k3 = AutoTokenizer.from_pretrained(runs["base"], trust_remote_code=True)
    ids = torch.tensor([_rendering(k3, runs["records"][0])[:256]])

    def model(path, adapter=None, dtype=torch.float32):
        loaded = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
        return (loaded if adapter is None else PeftModel.from_pretrained(loaded, adapter)).eval()

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits.float()

    run = model(twin, os.path.join(runs["ep2"]["run"], "adapter"))
    out = {
        "base": logits(model(twin)),
        "packed base": logits(model(runs["base"])),
        "run": logits(run),
        "peft": logits(model(twin, runs["exports"]["peft"])),
        "merged-k3": logits(model(runs["exports"]["merged-k3"])),
    }
    with torch.no_grad():
        out["peft merged"] = {n: p.detach().clone() for n, p in run.merge_and_unload().named_parameters()}
    for key, path in (("merged-k3 stored", runs["exports"]["merged-k3"]), ("base stored", twin)):
        out[key] = {n: p.detach() for n, p in model(path, dtype="auto").named_parameters()}
    return out


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_peft_export_reloads_with_plain_peft_as_trained(reloaded):
    assert _rel(reloaded["packed base"], reloaded["base"]) <= 1e-6  # premise: the twin is the base
    moved = _rel(reloaded["run"], reloaded["base"])
    assert moved > 0.05, moved  # the run's adapter changed the logits measurably
    assert _rel(reloaded["peft"], reloaded["run"]) <= 1e-5


def test_merged_k3_reloads_as_plain_pefts_merge_rounded_once(reloaded):
    """Each merged-k3 tensor is plain peft's ``merge_and_unload`` of the run's adapter rounded once to the
    dtype the base stores it in (bf16: within its unit roundoff 2^-8; the fp32 families exact). Its logits are
    then compared loosely only: on this tiny random MoE a bf16 rounding flips near-tied top-2 routings, which
    moves the logits by a few per cent (D's export self-check compares them with the rounding reproduced)."""
    want, got, base = reloaded["peft merged"], reloaded["merged-k3 stored"], reloaded["base stored"]
    assert set(got) == set(want)
    changed = []
    for name, value in got.items():
        assert value.dtype == base[name].dtype, name
        if value.dtype == torch.float32:
            assert torch.equal(value, want[name]), name
        else:
            err = (value.float() - want[name]).abs() - 2**-8 * want[name].abs()
            assert float(err.max()) <= 1e-9, (name, float(err.max()))
        if not torch.equal(value, base[name]):
            changed.append(name)
    targets = ("q_proj.weight", "k_proj.weight", "gate.weight", "wqkv.weight", "experts.w1", "experts.w2", "experts.w3")
    assert changed and all(n.endswith(targets) for n in changed), changed
    assert any("vision_tower" in n for n in changed) and any("experts" in n for n in changed), changed
    moved = _rel(reloaded["run"], reloaded["base"])
    assert _rel(reloaded["merged-k3"], reloaded["run"]) < 0.2 * moved


@pytest.mark.parametrize("to", EXPORTS)
def test_each_exports_tokenizer_renders_the_records_to_the_bases_ids(runs, to):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(runs["base"], trust_remote_code=True)
    exported = AutoTokenizer.from_pretrained(runs["exports"][to], trust_remote_code=True)
    for record in runs["records"]:
        assert _rendering(exported, record) == _rendering(base, record)
