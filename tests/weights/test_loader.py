"""load_state streams a checkpoint into a model: equal tensors, each shard opened once, one tensor alive at a
time, layout detected, and nothing written when the checkpoint does not match."""

import weakref
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_plugin.models import MoEPluginForCausalLM, preset_config, save_k3_checkpoint
from moe_plugin.weights import load_state

EXPERT_ROW = 32 * 32  # one expert of a tiny stack: [F, L] = [32, 32]


def tiny(seed, **overrides):
    torch.manual_seed(seed)
    return MoEPluginForCausalLM(preset_config("tiny", vision_config=None, image_token_id=None, **overrides))


class ReadTracker:
    """``open_file`` for load_state over safetensors: counts opens per file, and for every read how many of
    the tensors it returned are still alive (weakref finalizers), and the largest such count and bytes."""

    def __init__(self):
        self.opens, self.alive, self.alive_bytes = Counter(), 0, 0
        self.max_alive, self.max_alive_bytes, self.reads = 0, 0, []

    def _track(self, name, value):
        nbytes = value.numel() * value.element_size()
        self.alive += 1
        self.alive_bytes += nbytes
        self.max_alive, self.max_alive_bytes = (
            max(self.max_alive, self.alive),
            max(self.max_alive_bytes, self.alive_bytes),
        )
        self.reads.append((name, value.numel()))
        weakref.finalize(value, self._release, nbytes)
        return value

    def _release(self, nbytes):
        self.alive -= 1
        self.alive_bytes -= nbytes

    def __call__(self, file):
        self.opens[file] += 1
        tracker, handle = self, safe_open(file, framework="pt")

        class Slice:
            def __init__(self, inner, name):
                self.inner, self.name = inner, name

            def __getitem__(self, index):
                return tracker._track(self.name, self.inner[index])

        class Handle:
            def __enter__(self):
                self.file = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, name):
                return tracker._track(name, self.file.get_tensor(name))

            def get_slice(self, name):
                return Slice(self.file.get_slice(name), name)

        return Handle()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    source = tiny(seed=0)
    source.save_pretrained(root / "hf", max_shard_size="100KB")
    save_k3_checkpoint(source, root / "k3", max_shard_size="100KB")
    return root, {k: v.detach().clone() for k, v in source.state_dict().items()}


@pytest.mark.parametrize("layout", ["hf", "k3"])
def test_streamed_load_equals_the_source_one_tensor_at_a_time(checkpoints, layout):
    root, want = checkpoints
    model = tiny(seed=1)
    config = model.config.to_model_config()
    tracker = ReadTracker()
    stats = load_state(model, root / layout, names="hf", config=config, open_file=tracker)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert stats.layout == layout
    shards = sorted(str(p) for p in (root / layout).glob("*.safetensors"))
    assert len(shards) > 1 and sorted(tracker.opens) == shards and set(tracker.opens.values()) == {1}
    # every read tensor was dropped before the next read: never two alive at once
    assert tracker.max_alive == 1, tracker.max_alive
    largest = max(v.numel() * v.element_size() for v in want.values())
    assert tracker.max_alive_bytes <= largest
    expert_reads = [numel for name, numel in tracker.reads if ".experts." in name]
    assert len(expert_reads) == 3 * 3 * 8 and set(expert_reads) == {EXPERT_ROW}, "one expert row per read"
    assert stats.expert_elements == sum(expert_reads) == 3 * 3 * 8 * EXPERT_ROW
    assert stats.elements == sum(numel for _, numel in tracker.reads)


def test_tied_embeddings_load_from_the_stored_embedding(tmp_path):
    source = tiny(seed=2, tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "hf")
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    model = tiny(seed=3, tie_word_embeddings=True)
    load_state(model, tmp_path / "hf", names="hf", config=model.config.to_model_config())
    assert torch.equal(model.lm_head.weight, source.model.embed_tokens.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])


def test_mismatching_checkpoint_raises_before_anything_is_written(checkpoints, tmp_path):
    root, want = checkpoints
    state = load_file(str(next((root / "hf").glob("*.safetensors"))))  # one shard: many tensors missing
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(60, 64)
    state["model.layers.9.extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = tiny(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_state(model, tmp_path, names="hf", config=model.config.to_model_config())
    message = str(err.value)
    assert message.startswith("checkpoint: ") and "tensors of the model are missing" in message
    assert "1 tensors the model does not have: ['model.layers.9.extra.weight']" in message
    assert "model.layers.0.self_attn.q_proj.weight: checkpoint [60, 64], model [64, 64]" in message
    assert str(tmp_path) in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "a failed load wrote tensors"


def test_bad_arguments_name_the_argument(checkpoints):
    root, _ = checkpoints
    model = tiny(seed=5)
    with pytest.raises(ValueError, match="^names: must be one of"):
        load_state(model, root / "hf", names="deepspeed", config=model.config.to_model_config())
    with pytest.raises(ValueError, match="^config: must be a ModelConfig, got MoEPluginConfig"):
        load_state(model, root / "hf", names="hf", config=model.config)
    with pytest.raises(ValueError, match="^path: .* holds neither"):
        load_state(model, root, names="hf", config=model.config.to_model_config())
