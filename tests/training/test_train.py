"""The recipe-driven training entry: bad recipes name the field, and real runs make the loss fall."""

import json

import pytest

from moe_plugin.train import train
from moe_plugin.training.data import arithmetic_documents, batches, pack_documents
from moe_plugin.training.recipe import load_recipe, recipe_from_dict


def _mean(xs):
    return sum(xs) / len(xs)


def test_main_recipe_fine_tunes_the_shipped_base(tmp_path):
    recipe = load_recipe("recipes/tiny_lora.json")
    recipe.train.steps, recipe.train.output_dir = 40, str(tmp_path / "lora")
    losses = train(recipe)["losses"]
    assert _mean(losses[-5:]) < 0.75 * losses[0], losses
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()


def test_full_parameter_training_from_a_preset(tmp_path):
    recipe = recipe_from_dict({"model": {"preset": "tiny"}, "lora": None,
                               "data": {"num_documents": 300, "seq_len": 64},
                               "train": {"steps": 30, "lr": 3e-3, "output_dir": str(tmp_path / "full")}})
    losses = train(recipe)["losses"]
    assert _mean(losses[-5:]) < 0.8 * losses[0], losses
    assert (tmp_path / "full" / "config.json").exists()


def test_jsonl_data(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in arithmetic_documents(200, operation="*")))
    recipe = recipe_from_dict({"data": {"kind": "jsonl", "path": str(path), "seq_len": 64},
                               "train": {"steps": 3, "output_dir": str(tmp_path / "out")}})
    assert len(train(recipe)["losses"]) == 3


def test_packed_windows_mark_every_document_start():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    windows = pack_documents(docs, seq_len=4)
    assert [w[0].tolist() for w in windows] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [w[1].tolist() for w in windows] == [[0, 3, 4], [0, 1, 4]]
    ids, cu = next(batches(windows, 2, seed=0))
    assert ids.shape == (1, 8) and cu[-1] == 8 and sorted(cu.tolist()) == cu.tolist()
