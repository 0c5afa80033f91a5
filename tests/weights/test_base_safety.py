"""A base checkpoint that is damaged, holds NaN or inf, or stores weights in a dtype its own config does not
declare is refused at load with the file and the tensor named; nothing reaches safetensors' own errors."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_plugin.fileio import read_safetensors_header, safetensors_weight_map
from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint, preset_config
from moe_plugin.testing.packed_checkpoints import write_tiny_packed_checkpoint
from moe_plugin.weights.base_loading import load_base
from moe_plugin.weights import load_state, stored_tensors
from moe_plugin.weights.checks import check_module_finite, dtype_problems

NORM = "model.norm.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EXPERTS = "model.layers.1.block_sparse_moe.experts.w1"  # a stacked [E, F, L] tensor, read one expert at a time
ROUTER = "model.layers.1.block_sparse_moe.gate.weight"
FIX = "; re-download or re-save it"


def tiny_config():
    return preset_config("tiny", vision_config=None, image_token_id=None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny fp32 checkpoint (config.json says float32) and the tensors it holds."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    MoEPluginForCausalLM(tiny_config()).save_pretrained(path)
    return path, load_file(str(path / "model.safetensors"))


def copy_with(base, tmp_path, changes=None, config=None):
    """A copy of the base checkpoint with some tensors replaced, or config.json's keys changed."""
    path, tensors = base
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    settings = json.loads((path / "config.json").read_text())
    settings.update(config or {})
    (out / "config.json").write_text(json.dumps(settings))
    save_file({**tensors, **(changes or {})}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load(path):
    model = MoEPluginForCausalLM(tiny_config())
    return load_state(model, path, names="hf", config=model.config.to_model_config())


def shard_bytes(path):
    raw = (path / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw, length, json.loads(raw[8 : 8 + length])


def damaged(tmp_path, raw):
    path = tmp_path / "damaged"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(raw)
    return path, str(path / "model.safetensors")


def with_header(raw, length, header):
    """``raw`` with its header replaced by ``header`` (JSON), its data bytes unchanged."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + length :]


def refused(path, file):
    """The one-line message of the ValueError a load of ``path`` raises, checked to name ``file``."""
    with pytest.raises(ValueError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"path: {file}: damaged safetensors file: ") and message.endswith(FIX), message
    return message


def test_a_truncated_file_is_named(base, tmp_path):
    raw, length, header = shard_bytes(base[0])
    path, file = damaged(tmp_path, raw[:-10])
    last = max(header.items(), key=lambda item: item[1]["data_offsets"][1] if item[0] != "__metadata__" else -1)[0]
    data = len(raw) - 10 - 8 - length
    assert refused(path, file) == (
        f"path: {file}: damaged safetensors file: tensor {last!r} ends at data byte "
        f"{data + 10} but the file holds only {data} data bytes (cut short, or a header "
        f"that does not describe this file){FIX}"
    )
    path, file = damaged(tmp_path / "tiny", raw[:5])
    assert "holds 5 bytes, fewer than the 8-byte header length" in refused(path, file)


def test_a_header_length_past_the_file_is_named(base, tmp_path):
    raw, length, _ = shard_bytes(base[0])
    path, file = damaged(tmp_path, (len(raw) + 100).to_bytes(8, "little") + raw[8:])
    assert f"(its header length field says {len(raw) + 100} bytes, but {len(raw) - 8} follow)" in refused(path, file)


def test_a_header_that_is_not_json_is_named(base, tmp_path):
    raw, length, _ = shard_bytes(base[0])
    path, file = damaged(tmp_path, raw[:8] + b"\xff" + raw[9:])
    assert f"its {length}-byte header is not JSON (UnicodeDecodeError: " in refused(path, file)
    path, file = damaged(tmp_path / "text", raw[:8] + b"[" + raw[9:])
    assert f"its {length}-byte header is not JSON (JSONDecodeError: " in refused(path, file)


def test_a_lying_header_is_named(base, tmp_path):
    raw, length, header = shard_bytes(base[0])
    beyond = json.loads(json.dumps(header))
    begin, end = beyond[NORM]["data_offsets"]
    beyond[NORM]["data_offsets"] = [begin + 10**9, end + 10**9]
    path, file = damaged(tmp_path, with_header(raw, length, beyond))
    assert f"tensor {NORM!r} ends at data byte {end + 10**9} but the file holds only" in refused(path, file)

    wrong_size = json.loads(json.dumps(header))
    wrong_size[NORM]["shape"] = [wrong_size[NORM]["shape"][0] * 2]
    path, file = damaged(tmp_path / "size", with_header(raw, length, wrong_size))
    assert f"tensor {NORM!r} (F32 [128]) needs 512 bytes but its data_offsets [{begin}, {end}] span 256" in refused(
        path, file
    )

    others = sorted((e["data_offsets"], n) for n, e in header.items() if n != "__metadata__" and n != NORM)
    overlap = json.loads(json.dumps(header))
    overlap[NORM]["data_offsets"] = [others[0][0][0], others[0][0][0] + end - begin]  # on another tensor's bytes
    path, file = damaged(tmp_path / "overlap", with_header(raw, length, overlap))
    assert "(the header's data ranges overlap or leave a gap)" in refused(path, file)

    dtype = json.loads(json.dumps(header))
    dtype[NORM]["dtype"] = "F31"
    path, file = damaged(tmp_path / "dtype", with_header(raw, length, dtype))
    assert f"tensor {NORM!r} has the unknown dtype 'F31'" in refused(path, file)


def test_every_reader_of_a_shard_checks_its_header(base, tmp_path):
    raw, length, _ = shard_bytes(base[0])
    path, file = damaged(tmp_path, raw[:-10])
    for read in (
        lambda: safetensors_weight_map(path),
        lambda: read_safetensors_header(file),
        lambda: stored_tensors({NORM: file}),
    ):
        with pytest.raises(ValueError, match=f"^path: {file}: damaged safetensors file: "):
            read()
    (path / "model.safetensors").rename(path / "shard-1.safetensors")
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=r"^path: .*model\.safetensors\.index\.json is not valid JSON"):
        safetensors_weight_map(path)


def test_a_good_header_is_read_as_written(base):
    header = read_safetensors_header(base[0] / "model.safetensors")
    assert "__metadata__" not in header
    assert {n: (e["dtype"], e["shape"]) for n, e in header.items()} == {
        n: ("F32", list(t.shape)) for n, t in base[1].items()
    }


@pytest.mark.parametrize(
    "name,index,value", [(NORM, (7,), math.nan), (Q_PROJ, (3, 5), math.inf), (EXPERTS, (5, 2, 1), -math.inf)]
)
def test_non_finite_weights_are_refused_naming_the_tensor(base, tmp_path, name, index, value):
    bad = base[1][name].clone()
    bad[index] = value
    path = copy_with(base, tmp_path, {name: bad})
    file = str(path / "model.safetensors")
    # a stacked expert tensor is read one expert row at a time: the index is within expert 5's row
    where = list(index[1:]) if name == EXPERTS else list(index)
    with pytest.raises(ValueError) as caught:
        load(path)
    assert str(caught.value) == (
        f"path: {file}: tensor {name} holds 1 non-finite value(s) (NaN or inf, the first at "
        f"index {[0, *where] if name == EXPERTS else where}), which would train to a NaN "
        "loss; the checkpoint is damaged: re-download it or re-save it from a good copy"
    )


def test_the_trainer_backends_refuse_a_nan_base(base, tmp_path):
    """``weights.base_loading.load_base``: what both backends call to load ``model.from_pretrained``."""
    bad = base[1][NORM].clone()
    bad[0] = math.nan
    path = copy_with(base, tmp_path, {NORM: bad})
    model = MoEPluginForCausalLM(tiny_config())
    with pytest.raises(ValueError, match=f"^path: .*model\\.safetensors: tensor {NORM} holds 1 non-finite"):
        load_base(model, SimpleNamespace(path=str(path), model_config=model.config.to_model_config()), names="hf")


def test_a_model_loaded_elsewhere_is_checked_the_same_way(base):
    """``check_module_finite``: for a model transformers' ``from_pretrained`` loaded."""
    model = MoEPluginForCausalLM.from_pretrained(base[0])
    check_module_finite(model, str(base[0]))
    with torch.no_grad():
        model.get_parameter(Q_PROJ)[1, 2] = math.inf
    assert message_of_check(lambda: check_module_finite(model, str(base[0]))) == (
        f"path: {base[0]}: tensor {Q_PROJ} holds 1 non-finite value(s) (NaN or inf, the first at index [1, 2]), which "
        "would train to a NaN loss; the checkpoint is damaged: re-download it or re-save it from a good copy"
    )


def message_of_check(call):
    with pytest.raises(ValueError) as caught:
        call()
    return str(caught.value)


def test_a_float_weight_stored_as_int32_is_refused(base, tmp_path):
    path = copy_with(base, tmp_path, {NORM: base[1][NORM].round().to(torch.int32)})
    model = MoEPluginForCausalLM(tiny_config())
    before = model.state_dict()[NORM].clone()
    with pytest.raises(ValueError) as caught:
        load_state(model, path, names="hf", config=model.config.to_model_config())
    assert str(caught.value) == (
        f"path: {path}: 1 tensor(s) stored as int32 but the model's tensor is floating "
        f"(float32): ['{NORM}']; re-save the checkpoint with its floating weights in "
        "float32 (or correct config.json's dtype)"
    )
    assert torch.equal(model.state_dict()[NORM], before)  # refused before anything was written


def test_a_dtype_other_than_the_configs_is_refused(base, tmp_path):
    path = copy_with(base, tmp_path, {Q_PROJ: base[1][Q_PROJ].to(torch.bfloat16)})
    with pytest.raises(ValueError) as caught:
        load(path)
    assert str(caught.value) == (
        f"path: {path}: 1 tensor(s) stored as bfloat16 but the checkpoint's config.json "
        f"says float32: ['{Q_PROJ}']; re-save the checkpoint with its floating weights in "
        "float32 (or correct config.json's dtype)"
    )
    lying = copy_with(base, tmp_path / "lying", config={"dtype": "bfloat16"})
    with pytest.raises(ValueError) as caught:
        load(lying)
    # every floating weight but the ones the model keeps fp32 (router, its bias, A_log, dt_bias) and the ones K3
    # stores in fp32 under its bf16 dtype (the short convolutions, the output norm: test_stored_fp32.py)
    fp32_legal = ("gate.weight", "e_score_correction_bias", "A_log", "dt_bias", "conv1d.weight", "o_norm.weight")
    unkept = [n for n in base[1] if not n.endswith(fp32_legal)]
    assert str(caught.value).startswith(
        f"path: {lying}: {len(unkept)} tensor(s) stored as float32 but the checkpoint's config.json says bfloat16: ["
    )
    assert ROUTER not in str(caught.value)


def test_a_bf16_base_with_its_fp32_tensors_loads(tmp_path):
    torch.manual_seed(1)
    saved = MoEPluginForCausalLM(tiny_config()).to(torch.bfloat16)
    saved.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert read_safetensors_header(tmp_path / "model.safetensors")[ROUTER]["dtype"] == "F32"  # the policy's
    model = MoEPluginForCausalLM(tiny_config()).to(torch.bfloat16)
    load_state(model, tmp_path, names="hf", config=model.config.to_model_config())
    assert torch.equal(model.state_dict()[ROUTER], saved.state_dict()[ROUTER])
    # the same exemption under the K2 family's MoE block name
    assert dtype_problems(
        [
            ("model.layers.1.mlp.gate.weight", "f", "float32", torch.bfloat16),
            ("model.layers.1.mlp.gate_proj.weight", "f", "float32", torch.bfloat16),
        ],
        "bfloat16",
    ) == {"stored as float32 but the checkpoint's config.json says bfloat16": ["model.layers.1.mlp.gate_proj.weight"]}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    for fmt in ("mxfp4", "int4"):
        write_tiny_packed_checkpoint(root / fmt, fmt, vision_config=None, image_token_id=None)
    return root


def packed_copy(packed, fmt, tmp_path, name, edit):
    tensors = load_file(str(packed / fmt / "model.safetensors"))
    tensors[name] = edit(tensors[name].clone())
    out = tmp_path / fmt
    out.mkdir(parents=True)
    shutil.copy(packed / fmt / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_packed_scales_are_checked_by_what_they_decode_to(packed, tmp_path):
    mx = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    path = packed_copy(packed, "mxfp4", tmp_path, mx, lambda s: s.index_fill_(0, torch.tensor([0]), 0xFF))
    with pytest.raises(
        ValueError,
        match=f"^path: .*: tensor {mx}: scale byte 0xFF \\(NaN in the MX specification\\) at index \\[0, 0\\]",
    ):
        load_k3_checkpoint(path)

    names = list(load_file(str(packed / "int4" / "model.safetensors")))
    int4 = next(n for n in names if n.endswith("experts.3.w2.weight_scale"))

    def bits(value):  # a bf16 scale with these 16 bits
        return lambda s: s.index_fill_(
            0, torch.tensor([0]), torch.tensor(value, dtype=torch.int16).view(torch.bfloat16).item()
        )

    # 0x3CFF is a finite bf16 (about 0.031) whose low byte is 0xFF: no MXFP4 rule applies to INT4 scales
    load_k3_checkpoint(packed_copy(packed, "int4", tmp_path / "finite", int4, bits(0x3CFF)))
    nan = packed_copy(packed, "int4", tmp_path / "nan", int4, bits(0x7FC0))
    with pytest.raises(ValueError, match=f"^path: .*: tensor {int4} holds \\d+ non-finite value\\(s\\)"):
        load_k3_checkpoint(nan)
