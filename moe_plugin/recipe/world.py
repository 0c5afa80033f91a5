"""What a recipe asks of the processes it is launched on: the world size the launcher gives, and the recipe's
expert- and context-parallel layout checked against it and the model, before any process group exists."""

from __future__ import annotations

import os

from .schema import Recipe

__all__ = ["env_world_size", "check_layout"]


def env_world_size() -> int:
    """The launcher's ``WORLD_SIZE`` (1 when unset), read before any process group exists."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(
            f"WORLD_SIZE: must be a positive integer, got {text!r}; launch with torchrun or "
            "deepspeed, or unset it for one process"
        )
    return int(text)


def check_layout(recipe: Recipe, world_size: int, num_experts: int, expert_format: str = "dense") -> None:
    """Refuse an expert-parallel layout that cannot be built, before any process group exists.
    ``expert_format``: the base's (``MoEConfig.expert_format``), "dense" or a packed one."""
    ep, field = recipe.parallel.expert_parallel_size, "parallel.expert_parallel_size"
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world size (WORLD_SIZE): must be a positive integer, got {world_size!r}")
    both = [d for d in range(1, min(num_experts, world_size) + 1) if num_experts % d == 0 and world_size % d == 0]
    problems = []
    if recipe.parallel.backend == "hf" and ep > 1 and expert_format != "dense":
        problems.append(
            f"is {ep}, but the Hugging Face backend's expert parallelism takes dense experts and the "
            f'base\'s are {expert_format!r}; use parallel.backend "megatron" (or expert_parallel_size 1)'
        )
    if recipe.parallel.backend == "hf" and ep > 1 and recipe.lora is None:
        problems.append(
            f'is {ep}, but full training ("lora": null) on the Hugging Face backend runs without '
            'expert parallelism; use parallel.backend "megatron" (or expert_parallel_size 1)'
        )
    if num_experts % ep:
        problems.append(
            f"{ep} does not divide the model's {num_experts} experts; use one that divides both the "
            f"experts and the world size {world_size}: {both}"
        )
    if world_size % ep:
        problems.append(
            f"{ep} does not divide the world size {world_size} (WORLD_SIZE); launch a multiple of "
            f"{ep} processes, or use one of {both}"
        )
    lines = [f"{field}: {problem}" for problem in problems]
    chunks = recipe.parallel.moe_overlap_chunks
    if chunks > 1 and ep > 1 and num_experts % ep == 0 and chunks > num_experts // ep:
        lines.append(
            f"parallel.moe_overlap_chunks: {chunks} is more than the {num_experts // ep} experts a rank holds at "
            f"expert parallelism {ep} (chunks group a rank's experts); use 1 to {num_experts // ep}"
        )
    cp = recipe.parallel.context_parallel_size
    if world_size % cp:
        lines.append(
            f"parallel.context_parallel_size: {cp} does not divide the world size {world_size} (WORLD_SIZE); "
            f"launch a multiple of {cp} processes"
        )
    if lines:
        raise ValueError("\n".join(lines))
