"""Saves are all-or-nothing: a failed save never harms the last good checkpoint, a new one leaves no stale file."""

import json
import os

import pytest
import torch

import moe_plugin
from moe_plugin.fileio import atomic_directory, write_json_atomic
from moe_plugin.models import MoEPluginForCausalLM, load_k3_checkpoint, save_k3_checkpoint


def test_failed_save_keeps_the_previous_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        (open(os.path.join(d, "weights.bin"), "w")).write("good")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(target) as d:
            (open(os.path.join(d, "weights.bin"), "w")).write("half")
            raise RuntimeError("disk full")
    assert (target / "weights.bin").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind


def test_new_save_replaces_every_old_file(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as d:
        for i in range(3):
            open(os.path.join(d, f"shard-{i}"), "w").write("x")
    with atomic_directory(target) as d:
        open(os.path.join(d, "single"), "w").write("y")
    assert os.listdir(target) == ["single"]


def test_json_write_failure_keeps_old_file(tmp_path):
    path = tmp_path / "config.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["config.json"]


def test_k3_resave_with_fewer_shards_loads_the_new_weights(tmp_path):
    config = moe_plugin.preset_config("tiny", attn_res=False, use_dsa_indexer=False, vision_config=None,
                                      image_token_id=None)
    torch.manual_seed(0)
    first = MoEPluginForCausalLM(config)
    torch.manual_seed(1)
    second = MoEPluginForCausalLM(config)
    save_k3_checkpoint(first, tmp_path / "k3", max_shard_size=200_000)  # several shards and an index
    save_k3_checkpoint(second, tmp_path / "k3")  # one file: the old index must not survive
    assert not (tmp_path / "k3" / "model.safetensors.index.json").exists()
    loaded = load_k3_checkpoint(tmp_path / "k3")
    for (name, a), b in zip(second.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_weight_map_names_the_path_when_there_is_no_checkpoint(tmp_path):
    from moe_plugin.fileio import safetensors_weight_map

    with pytest.raises(ValueError, match="^path: .* holds neither"):
        safetensors_weight_map(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"^path: .*shard-1\.safetensors"):
        safetensors_weight_map(tmp_path)
