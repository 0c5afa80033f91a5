"""The tiny K3 release writer (moe_plugin/testing/k3_release.py) checked against the release's facts kept as
data in tests/fixtures/k3/ (config.json: the published file, every key; weight_families.tsv: the release's 60
tensor-name families with shapes and dtypes) and the K3 tokenizer fixture (tests/fixtures/k3_tokenizer/)."""

import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from moe_plugin.testing.k3_release import (
    PUBLISHED_CONFIG,
    read_published_config,
    release_tensor_specs,
    shrink_k3_config,
    write_k3_release,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FAMILIES = os.path.join(FIXTURES, "k3", "weight_families.tsv")
TOKENIZER = os.path.join(FIXTURES, "k3_tokenizer")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8}
_INDEX = re.compile(r"\.(layers|experts|blocks)\.\d+\.")
_PLACEHOLDER = {"layers": "{L}", "experts": "{E}", "blocks": "{B}"}


def _family_of(name):
    """The family pattern of a tensor name: layer, expert and block indices replaced by placeholders."""
    return _INDEX.sub(lambda m: f".{m.group(1)}.{_PLACEHOLDER[m.group(1)]}.", name)


def read_families():
    """{family pattern: (shape, dtype, expected count)} from the tsv; layer 0's dense MLP under {L}."""
    out = {}
    with open(FAMILIES) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            pattern, where, shape, dtype = line.rstrip("\n").split("\t")[:4]
            count = 1
            layers = re.search(r"x(\d+)", where)
            if layers:
                count = int(layers.group(1))
            experts = re.search(r"E 0\.\.(\d+)", where)
            if experts:
                count *= int(experts.group(1)) + 1
            blocks = re.search(r"B 0\.\.(\d+)", where)
            if blocks:
                count = int(blocks.group(1)) + 1
            shape = tuple(int(x) for x in shape.strip("[]").split(","))
            out[_family_of(pattern.replace("layers.0.", "layers.{L}."))] = (shape, _DTYPES[dtype], count)
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3") / "release"
    written = write_k3_release(path, seed=0, tokenizer_dir=TOKENIZER)
    return path, written


def _stored(path):
    """{name: (shape, dtype)} of every tensor in the directory's shards, and {name: file}."""
    out, where = {}, {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    out[name], where[name] = (tuple(t.shape), t.dtype), file
    return out, where


def _key_paths(d, prefix=""):
    paths = set()
    for key, value in d.items():
        paths.add(prefix + key)
        if isinstance(value, dict):
            paths |= _key_paths(value, prefix + key + ".")
    return paths


def test_release_specs_at_full_size_are_the_published_families():
    """The writer's names, shapes and dtypes at the published config's own sizes are the release's: every
    family of weight_families.tsv with its shape, dtype and number of tensors (497,220 in all)."""
    families = read_families()
    assert len(families) == 60
    seen, layers_of = {}, {}
    for spec in release_tensor_specs(read_published_config()):
        family = _family_of(spec.name)
        assert family in families, f"{spec.name}: no family of the release has it"
        shape, dtype, _ = families[family]
        assert (spec.shape, spec.dtype) == (shape, dtype), spec.name
        seen[family] = seen.get(family, 0) + 1
        layer = re.search(r"\.layers\.(\d+)\.", spec.name)
        if layer:
            layers_of.setdefault(family, set()).add(int(layer.group(1)))
    assert {f: c for f, (_, _, c) in families.items()} == seen
    assert sum(seen.values()) == 497_220
    # the tsv's header: MLA layers (0-based) 3, 7, ..., 87, 91 and 92; the dense MLP in layer 0 only
    mla = set(range(3, 92, 4)) | {92}
    assert layers_of[_family_of("language_model.model.layers.0.self_attn.q_a_proj.weight")] == mla
    assert layers_of[_family_of("language_model.model.layers.0.self_attn.A_log")] == set(range(93)) - mla
    assert layers_of[_family_of("language_model.model.layers.0.mlp.up_proj.weight")] == {0}


def test_shrunk_config_keeps_every_published_key():
    published = read_published_config()
    tiny = shrink_k3_config(published)
    assert _key_paths(tiny) == _key_paths(published)
    # the format keys are the release's, untouched
    for key in ("quantization_config", "auto_map", "architectures", "model_type", "hidden_act", "dtype"):
        assert tiny["text_config"][key] == published["text_config"][key]
    assert tiny["model_type"] == "kimi_k3" and tiny["image_placeholder"] == "<|kimi_image_placeholder|>"
    with pytest.raises(KeyError, match="text_config.no_such_size"):
        shrink_k3_config(published, sizes={"text": {"no_such_size": 1}})


def test_written_release_names_and_dtypes_are_the_families(release):
    """Every tensor written matches one family of the release with the family's dtype, and every family is
    there (the tiny shape has all of them: a dense KDA layer 0, KDA and MLA MoE layers, the tower)."""
    path, written = release
    families = read_families()
    stored, where = _stored(path)
    for name, (_shape, dtype) in stored.items():
        family = _family_of(name)
        assert family in families, f"{name}: no family of the release has it"
        assert dtype == families[family][1], name
    assert {_family_of(n) for n in stored} == set(families)
    # and the shapes are the ones the shrunk config gives
    config = json.loads((path / "config.json").read_text())
    assert {s.name: (s.shape, s.dtype) for s in release_tensor_specs(config)} == stored
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == where
    shards = sorted(set(where.values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):06d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in stored.values()
    )
    assert sum(os.path.getsize(path / f) for f in written) < 5e6


def test_written_release_token_ids_follow_the_tokenizer(release):
    """The config's ids are the tokenizer fixture's own tokens at those ids (its added_tokens_decoder), the
    vocabulary ends where its 256 special ids end, and generation_config.json's eos is <|end_of_msg|>."""
    path, written = release
    config = json.loads((path / "config.json").read_text())
    tokens = json.loads((path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    content = {int(i): t["content"] for i, t in tokens.items()}
    for section in (config, config["text_config"]):
        assert content[section["bos_token_id"]] == "[BOS]"
        assert content[section["eos_token_id"]] == "<|end_of_msg|>"
        assert content[section["pad_token_id"]] == "[PAD]"
    assert content[config["media_placeholder_token_id"]] == "<|media_pad|>"
    assert config["text_config"]["vocab_size"] == max(content) + 1
    generation = json.loads((path / "generation_config.json").read_text())
    assert content[generation["eos_token_id"]] == "<|end_of_msg|>"
    assert set(os.listdir(TOKENIZER)) <= set(written)


def test_written_release_is_deterministic(tmp_path, release):
    path, _ = release
    again = tmp_path / "again"
    write_k3_release(again, seed=0, tokenizer_dir=TOKENIZER)
    for file in sorted(os.listdir(path)):
        assert (path / file).read_bytes() == (again / file).read_bytes(), file


def test_published_config_is_the_fixture():
    assert os.path.samefile(PUBLISHED_CONFIG, os.path.join(FIXTURES, "k3", "config.json"))
