"""The recipe's balance-loss and capacity keys (moe_plugin/recipe/schema.py): lora.router_balance.aux_loss_coeff is
on by default whenever a LoRA target is the router and 0 turns it off; full training takes the top-level
router_balance beside the bias rule (off by default); parallel.capacity_factor defaults to the planner's 1.25."""

from __future__ import annotations

import pytest

from moe_plugin.recipe.schema import DEFAULT_ROUTER_AUX_LOSS_COEFF, RecipeError, recipe_from_dict
from tests.recipes import smallest


def _recipe(**sections):
    return recipe_from_dict(smallest(**sections))


def _problems(**sections):
    with pytest.raises(RecipeError) as caught:
        _recipe(**sections)
    return dict(caught.value.problems)


@pytest.mark.parametrize(
    "targets, want",
    [
        (["q_proj", "k_proj", "gate"], DEFAULT_ROUTER_AUX_LOSS_COEFF),  # the seed's targets
        (["block_sparse_moe.gate"], DEFAULT_ROUTER_AUX_LOSS_COEFF),
        (["q_proj", "gate_proj"], 0.0),  # the shared experts' gate_proj is not the router
    ],
)
def test_the_default_is_on_when_a_lora_target_is_the_router(targets, want):
    assert _recipe(lora={"target_modules": targets}).router_aux_loss_coeff() == want
    assert DEFAULT_ROUTER_AUX_LOSS_COEFF > 0


def test_the_recipe_sets_it_and_zero_turns_it_off():
    assert _recipe().router_aux_loss_coeff() == DEFAULT_ROUTER_AUX_LOSS_COEFF  # the default lora section
    assert _recipe(lora={"router_balance": {"aux_loss_coeff": 0}}).router_aux_loss_coeff() == 0.0
    assert _recipe(lora={"router_balance": {"aux_loss_coeff": 0.02}}).router_aux_loss_coeff() == 0.02
    problems = _problems(lora={"router_balance": {"aux_loss_coeff": -0.1}})
    assert problems["lora.router_balance.aux_loss_coeff"].startswith("must be >= 0, got -0.1;")


def test_full_training_takes_the_top_level_section_beside_the_bias_rule():
    assert _recipe(lora=None).router_aux_loss_coeff() == 0.0
    assert _recipe(lora=None, router_balance={"aux_loss_coeff": 0.01}).router_aux_loss_coeff() == 0.01
    message = _problems(router_balance={"aux_loss_coeff": 0.01})["router_balance"]
    assert "lora.router_balance.aux_loss_coeff" in message


def test_capacity_factor_defaults_to_the_planners_and_is_checked():
    assert _recipe().parallel.capacity_factor == 1.25
    assert _recipe(parallel={"capacity_factor": 2}).parallel.capacity_factor == 2.0
    assert _problems(parallel={"capacity_factor": 0.9})["parallel.capacity_factor"].startswith("must be >= 1")
