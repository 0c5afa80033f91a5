"""The read planner: which rows of which stored tensor land where, and its one error, on hand-made checkpoints."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moe_plugin.fileio import safetensors_weight_map
from moe_plugin.models import preset_config
from moe_plugin.weights.plan import detect_layout, plan_reads, stored_tensors
from moe_plugin.weights.reads import Read, Stored, Target

W1 = "model.layers.1.block_sparse_moe.experts.w1"  # the tiny preset: 8 experts, F = 32, L = 32


def config(**overrides):
    return preset_config("tiny", attn_res=False, vision_config=None, image_token_id=None, **overrides).to_model_config()


def plan(targets, shapes, **kwargs):
    stored = {name: Stored(f"{name.split('.')[-1]}.safetensors", shape, "float32") for name, shape in shapes.items()}
    return plan_reads(
        targets,
        {n: s.file for n, s in stored.items()},
        names="hf",
        stored=stored,
        config=kwargs.pop("cfg", None) or config(),
        **kwargs,
    )


def test_stacked_experts_read_only_this_ranks_rows_one_expert_at_a_time():
    got = plan({W1: Target((3, 32, 32), experts=(4, 7))}, {W1: (8, 32, 32)}, layout="hf")
    assert got.reads[W1] == [Read(W1, "w1.safetensors", W1, (e, e + 1), (e - 4) * 1024, expert=True) for e in (4, 5, 6)]


def test_k3_experts_read_only_this_ranks_per_expert_tensors():
    per_expert = {f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight": (32, 32) for e in range(8)}
    got = plan({W1: Target((2, 32, 32), experts=(2, 4))}, per_expert, layout="k3")
    assert [(r.name, r.rows, r.offset) for r in got.reads[W1]] == [
        ("model.layers.1.block_sparse_moe.experts.2.w1.weight", None, 0),
        ("model.layers.1.block_sparse_moe.experts.3.w1.weight", None, 1024),
    ]


def test_zero3_partition_reads_the_rows_that_cover_it():
    q = "model.layers.0.self_attn.q_proj.weight"
    # [6, 4] flattened: elements 10..19 lie in rows 2..4 (row 2 starts at element 8)
    got = plan({q: Target((6, 4), flat_range=(10, 20))}, {q: (6, 4)}, layout="hf")
    assert got.reads[q] == [Read(q, "weight.safetensors", q, (2, 5), 8)]
    whole = plan({q: Target((6, 4), flat_range=(0, 24))}, {q: (6, 4)}, layout="hf")
    assert whole.reads[q] == [Read(q, "weight.safetensors", q, None, 0)]
    padding_only = plan({q: Target((6, 4), flat_range=(24, 24))}, {q: (6, 4)}, layout="hf")
    assert padding_only.reads[q] == []
    # an expert stack of 8 rows of 1024: elements 1500..2100 lie in experts 1 and 2
    experts = plan({W1: Target((8, 32, 32), experts=(0, 8), flat_range=(1500, 2100))}, {W1: (8, 32, 32)}, layout="hf")
    assert [(r.rows, r.offset) for r in experts.reads[W1]] == [((1, 2), 1024), ((2, 3), 2048)]


def test_k3_a_log_is_read_whole_and_unpadded():
    a_log = "model.layers.0.self_attn.A_log"
    got = plan({a_log: Target((2,), flat_range=(1, 2))}, {a_log: (1, 1, 128, 1)}, layout="k3")
    assert got.reads[a_log] == [Read(a_log, "A_log.safetensors", a_log, None, 0, convert=True)]


def test_one_error_names_every_missing_unknown_and_misshapen_tensor():
    targets = {
        "model.norm.weight": Target((64,)),
        "model.layers.0.input_layernorm.weight": Target((64,)),
        W1: Target((8, 32, 32), experts=(0, 8)),
    }
    shapes = {"model.layers.0.input_layernorm.weight": (63,), W1: (8, 32, 31), "model.extra.weight": (3,)}
    with pytest.raises(ValueError) as err:
        plan(targets, shapes, layout="hf", source="/ckpt")
    message = str(err.value)
    assert message.startswith(
        "checkpoint: 1 tensors of the model are missing: ['model.norm.weight']; "
        "1 tensors the model does not have: ['model.extra.weight']"
    ), message
    assert "model.layers.0.input_layernorm.weight: checkpoint [63], model [64]" in message
    assert f"{W1}: checkpoint [8, 32, 31], model [8, 32, 32]" in message
    assert "[/ckpt: 1 missing, 1 unknown, 2 misshapen]" in message
    loose = plan(
        {"model.norm.weight": Target((64,))},
        {"model.norm.weight": (64,), "model.extra.weight": (3,)},
        layout="hf",
        strict=False,
    )
    assert loose.unknown == ["model.extra.weight"] and list(loose.reads) == ["model.norm.weight"]


def test_rank_error_names_other_ranks_missing_experts_and_the_global_shape():
    per_expert = {f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight": (32, 32) for e in range(8) if e != 6}
    with pytest.raises(ValueError, match=r"missing: \['model\.layers\.1\.block_sparse_moe\.experts\.6\.w1\.weight'\]"):
        plan({W1: Target((2, 32, 32), experts=(0, 2))}, per_expert, layout="k3")
    with pytest.raises(
        ValueError,
        match=r"checkpoint \[7, 32, 32\], model \[8, 32, 32\] \(this rank holds experts "
        r"2\.\.3\)",
    ):
        plan({W1: Target((2, 32, 32), experts=(2, 4))}, {W1: (7, 32, 32)}, layout="hf")


def test_tied_embedding_and_missing_indexer():
    tied = config(tie_word_embeddings=True)
    got = plan({"lm_head.weight": Target((384, 64))}, {"model.embed_tokens.weight": (384, 64)}, layout="k3", cfg=tied)
    assert got.reads["lm_head.weight"][0].name == "model.embed_tokens.weight"
    # megatron with shared embeddings has no output layer: a stored lm_head is not an unknown tensor
    assert plan({}, {"lm_head.weight": (384, 64)}, layout="hf", cfg=tied).unknown == []
    indexer = "model.layers.3.self_attn.indexer.wk.weight"
    assert plan({indexer: Target((4, 4))}, {}, layout="k3").fresh == [indexer]
    with pytest.raises(ValueError, match="indexer"):
        plan({indexer: Target((4, 4))}, {}, layout="hf")


def test_vision_and_mtp_tensors_are_dropped_only_when_asked():
    shapes = {"vision_tower.pos_embed": (2, 2), "model.layers.4.input_layernorm.weight": (64,)}
    with pytest.raises(ValueError) as err:
        plan({}, shapes, layout="k3")
    message = str(err.value)
    assert (
        "2 tensors the model does not have: ['model.layers.4.input_layernorm.weight', 'vision_tower.pos_embed']"
        in message
    )
    assert "multi-token-prediction layers are not supported: pass ignore_mtp=True" in message
    assert "under vision_tower./mm_projector. belong to the image model" in message and "ignore_vision=True" in message
    got = plan({}, shapes, layout="k3", ignore_vision=True, ignore_mtp=True)
    assert got.ignored == ["model.layers.4.input_layernorm.weight", "vision_tower.pos_embed"] and got.unknown == []


def test_mxfp4_checkpoint_is_refused_before_names_are_compared():
    stored = {f"{W1}.weight_packed": Stored("a", (8, 16), "uint8")}
    with pytest.raises(ValueError, match="^checkpoint: .*MXFP4-quantised tensors .* but the model.s experts are dense"):
        plan_reads({}, {n: "a" for n in stored}, names="hf", config=config(), stored=stored, layout="k3")


def test_headers_and_layout_from_files(tmp_path):
    save_file(
        {
            "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
            "model.layers.1.block_sparse_moe.experts.0.w1.weight": torch.zeros(2, 3),
        },
        str(tmp_path / "model.safetensors"),
    )
    weight_map = safetensors_weight_map(tmp_path)
    stored = stored_tensors(weight_map)
    assert stored["model.norm.weight"] == Stored(str(tmp_path / "model.safetensors"), (4,), "bfloat16")
    assert stored["model.layers.1.block_sparse_moe.experts.0.w1.weight"].shape == (2, 3)
    assert detect_layout(str(tmp_path), stored) == "k3"  # no config.json: one tensor per expert
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "moe_plugin"}))
    assert detect_layout(str(tmp_path), stored) == "hf"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    assert detect_layout(str(tmp_path), ["model.norm.weight"]) == "k3"
    assert detect_layout(None, ["model.norm.weight", W1]) == "hf"


def test_index_that_disagrees_with_its_shards_is_named(tmp_path):
    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    index = {"weight_map": {"a.weight": "one.safetensors", "b.weight": "one.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"^path: .*lists tensors that one\.safetensors does not hold: \['b\.weight'\]"
    ):
        stored_tensors(safetensors_weight_map(tmp_path))
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"^path: .*bad\.safetensors is not a safetensors file"):
        stored_tensors({"x": str(tmp_path / "bad.safetensors")})
