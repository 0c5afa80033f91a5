"""K3 as released stores a few families in fp32 under its bf16 ``dtype`` (docs/k3-formats.md "Tensors"): KDA's
``A_log`` (padded), ``dt_bias``, ``q/k/v_conv1d.weight``, ``o_norm.weight`` and the router's
``e_score_correction_bias``. Such a base loads; the precision policy keeps the families the model holds in fp32
exact and casts the others to the model's dtype, and says which in one logged line (docs/precision.md). A real
mismatch (a bf16 family stored as fp16, a projection stored in fp32) is still refused, naming the tensor.

The base is written by the tests' own K3-layout writer (tests/models/k3_fixtures.py), not the package's; the
reference values are the stored tensors read back with safetensors."""

import logging

import pytest
import torch

from moe_plugin.models import load_k3_checkpoint
from moe_plugin.precision import STORED_FP32, stored_fp32_family
from tests.models.k3_fixtures import k3_text_config, k3_text_shapes, random_tensors, read_dir, write_k3

# the release's fp32 families (docs/k3-formats.md), by the end of their K3 names
RELEASE_FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
KEPT = ("A_log", "dt_bias", "e_score_correction_bias")  # the model holds these in fp32 (precision.FP32_TENSORS)
CONV = "model.layers.0.self_attn.q_conv1d.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def release_dtypes(tensors):
    """The release's dtypes: its fp32 families in fp32, every other tensor in bf16."""
    return {n: t.float() if n.endswith(RELEASE_FP32) else t.bfloat16() for n, t in tensors.items()}


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_bf16")
    config = dict(k3_text_config(), dtype="bfloat16")
    tensors = release_dtypes(random_tensors(k3_text_shapes(config), num_heads=2))
    write_k3(path, config, tensors)
    return path, config, tensors


def _edited(tmp_path, bf16_base, changes):
    _, config, tensors = bf16_base
    write_k3(tmp_path, config, {**tensors, **changes})
    return tmp_path


def test_the_release_families_are_what_the_policy_accepts():
    """Every family the release stores in fp32 has a rule; a projection has none."""
    for name in (
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.k_conv1d.weight",
        "model.layers.0.self_attn.o_norm.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
    ):
        assert stored_fp32_family(name) is not None, name
    assert stored_fp32_family(Q_PROJ) is None
    assert {rule for _, _, rule in STORED_FP32} == {"keep", "cast"}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_bf16_release_base_with_fp32_families_loads(bf16_base, dtype, caplog):
    """Loaded in fp32 every tensor is the stored value; loaded in bf16 the kept families are still exact fp32
    and the cast ones are the stored value rounded to bf16 once. The logged line says which were which."""
    path, _, _ = bf16_base
    stored = read_dir(path)
    with caplog.at_level(logging.INFO, logger="moe_plugin.precision"):
        model = load_k3_checkpoint(path, dtype=dtype)
    state = model.state_dict()
    for name, value in stored.items():
        if not name.endswith(RELEASE_FP32):
            continue
        got = state[name]
        if name.endswith("A_log"):
            value = value[:2]  # 2 heads of the 128 stored
        elif name.endswith("conv1d.weight"):
            value = value.reshape(got.shape)
        if dtype is None or name.endswith(KEPT):
            assert got.dtype == torch.float32 and torch.equal(got, value), name
        else:
            assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), name
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_plugin.precision"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "stored in float32 under the checkpoint's dtype bfloat16" in line
    for family in ("A_log x3", "dt_bias x3", "e_score_correction_bias x3"):
        assert family in line.split("kept in float32: ")[1], line
    if dtype is None:
        assert "o_norm.weight x3" in line.split("kept in float32: ")[1] and "cast to" not in line
    else:
        cast = line.split("cast to the model's dtype: ")[1]
        assert "q/k/v_conv1d.weight x9 -> bfloat16" in cast and "o_norm.weight x3 -> bfloat16" in cast, line


def test_a_bf16_family_stored_as_fp16_is_refused_by_name(bf16_base, tmp_path):
    _, _, tensors = bf16_base
    path = _edited(tmp_path, bf16_base, {CONV: tensors[CONV].half()})
    with pytest.raises(ValueError) as err:
        load_k3_checkpoint(path)
    assert f"1 tensor(s) stored as float16 but the checkpoint's config.json says bfloat16: ['{CONV}']" in str(err.value)


def test_a_tensor_no_rule_allows_in_fp32_is_refused_by_name(bf16_base, tmp_path):
    _, _, tensors = bf16_base
    path = _edited(tmp_path, bf16_base, {Q_PROJ: tensors[Q_PROJ].float()})
    with pytest.raises(ValueError) as err:
        load_k3_checkpoint(path)
    assert f"stored as float32 but the checkpoint's config.json says bfloat16: ['{Q_PROJ}']" in str(err.value)
