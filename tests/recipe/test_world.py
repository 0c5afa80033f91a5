"""moe_plugin/recipe/world.py: the launcher's world size and the recipe's expert-parallel layout checked against
it and the model, each refusal asserted on its message."""

import pytest

from moe_plugin.recipe.schema import recipe_from_dict
from moe_plugin.recipe.world import check_layout, env_world_size
from tests.recipes import smallest


def _layout(ep, backend="megatron"):
    return recipe_from_dict(smallest(parallel={"expert_parallel_size": ep, "backend": backend}))


def test_check_layout():
    check_layout(_layout(2), world_size=4, num_experts=8)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: 3 does not divide the model's 8 experts"):
        check_layout(_layout(3), world_size=3, num_experts=8)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel_size: 2 does not divide the world size 3"):
        check_layout(_layout(2), world_size=3, num_experts=8)
    check_layout(_layout(2, "hf"), world_size=2, num_experts=8)  # the Hugging Face face has expert parallelism
    with pytest.raises(
        ValueError,
        match=r"^parallel\.expert_parallel_size: is 2, but the Hugging Face backend's "
        r"expert parallelism takes dense experts and the base's are 'mxfp4'; use "
        r"parallel\.backend \"megatron\"",
    ):
        check_layout(_layout(2, "hf"), world_size=2, num_experts=8, expert_format="mxfp4")
    full = recipe_from_dict(smallest(parallel={"expert_parallel_size": 2, "backend": "hf"}, lora=None))
    with pytest.raises(
        ValueError,
        match=r"^parallel\.expert_parallel_size: is 2, but full training \(\"lora\": "
        r"null\) on the Hugging Face backend runs without expert parallelism",
    ):
        check_layout(full, world_size=2, num_experts=8)


def test_env_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE: must be a positive integer, got 'two'"):
        env_world_size()


def test_overlap_chunks_group_a_ranks_experts():
    """parallel.moe_overlap_chunks cuts the experts a rank holds into chunks: more chunks than experts is refused
    with the field and the range that works; below 1 the schema refuses it."""
    chunked = recipe_from_dict(smallest(parallel={"expert_parallel_size": 2, "moe_overlap_chunks": 4}))
    check_layout(chunked, world_size=2, num_experts=8)  # 4 experts a rank: 4 chunks of one
    with pytest.raises(
        ValueError,
        match=r"^parallel\.moe_overlap_chunks: 4 is more than the 2 experts a rank holds at expert parallelism 4 "
        r"\(chunks group a rank's experts\); use 1 to 2",
    ):
        check_layout(recipe_from_dict(smallest(parallel={"expert_parallel_size": 4, "moe_overlap_chunks": 4})), 4, 8)
    with pytest.raises(ValueError, match=r"parallel\.moe_overlap_chunks"):
        recipe_from_dict(smallest(parallel={"moe_overlap_chunks": 0}))
