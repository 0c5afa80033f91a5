"""The recipe schema and the DeepSpeed config merge: each bad input is asserted on its message (the layout check:
tests/recipe/test_world.py)."""

import glob
import json

import pytest

from moe_plugin.models.configuration import MoEPluginConfig
from moe_plugin.models.k3_config import config_to_k3
from moe_plugin.models.presets import preset_config
from moe_plugin.training.ds_config import deepspeed_config
from moe_plugin.recipe.schema import LoraSection, RecipeError, load_recipe, recipe_from_dict
from moe_plugin.recipe.world import check_layout
from tests.recipes import smallest

SHIPPED_BASE = "recipes/bases/tiny-arith"


def _problems(values):
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict(values)
    assert isinstance(caught.value, ValueError)
    return dict(caught.value.problems)


@pytest.mark.parametrize("steps, shown", [("10", "'10' (a str)"), (2.5, "2.5 (a float)"), (True, "true (a bool)")])
def test_steps_must_be_an_integer(steps, shown):
    assert _problems(smallest(schedule={"steps": steps})) == {
        "schedule.steps": f"must be an integer, got {shown}; write a whole number without quotes, e.g. 60"
    }


def test_a_float_field_takes_an_int_but_not_a_string_or_a_bool():
    recipe = recipe_from_dict(smallest(schedule={"lr": 1}))
    assert recipe.schedule.lr == 1.0 and type(recipe.schedule.lr) is float
    problems = _problems(smallest(schedule={"lr": "3e-3", "min_lr": False}))
    assert problems["schedule.lr"].startswith("must be a number, got '3e-3' (a str)")
    assert problems["schedule.min_lr"].startswith("must be a number, got false (a bool)")


def test_logging_every_zero_is_refused():
    message = _problems(smallest(logging={"every": 0}))["logging.every"]
    assert message.startswith("must be > 0, got 0;") and "steps between log lines" in message


def test_lora_alpha_zero_says_the_adapter_would_do_nothing():
    message = _problems(smallest(lora={"alpha": 0}))["lora.alpha"]
    assert message.startswith("must be > 0, got 0;") and "an adapter that does nothing" in message


def test_negative_weight_decay_is_refused():
    assert _problems(smallest(schedule={"weight_decay": -0.1}))["schedule.weight_decay"].startswith(
        "must be >= 0, got -0.1;"
    )


@pytest.mark.parametrize("section", ["data", "schedule", "lora", "model"])
def test_a_list_instead_of_an_object(section):
    assert _problems(smallest(**{section: [1, 2]}))[section].startswith("must be a JSON object, got a list;")


def test_a_recipe_that_is_not_an_object():
    assert _problems([])["recipe"].startswith("must be a JSON object of sections, got a list")


def test_target_modules_as_a_string():
    assert _problems(smallest(lora={"target_modules": "q_proj"})) == {
        "lora.target_modules": "must be a list, got 'q_proj' (a str); use a list, e.g. [\"q_proj\"]"
    }


def test_no_lora_target_at_all():
    message = _problems(smallest(lora={"target_modules": [], "target_parameters": []}))["lora.target_modules"]
    assert "nothing would train" in message and '"lora": null' in message


def test_lora_null_trains_every_parameter_and_absent_lora_takes_the_defaults():
    assert recipe_from_dict(smallest(lora=None)).lora is None
    lora = recipe_from_dict(smallest()).lora
    assert lora == LoraSection() and lora.target_modules == ["q_proj", "k_proj", "gate"] and lora.alpha == 16.0


def test_unknown_preset():
    assert _problems(smallest(model={"preset": "huge"})) == {
        "model.preset": "unknown preset 'huge'; choose one of ['k3', 'tiny']"
    }


def test_both_preset_and_from_pretrained():
    message = _problems(smallest(model={"preset": "tiny", "from_pretrained": SHIPPED_BASE}))["model"]
    assert message.startswith("both model.preset and model.from_pretrained are given; give exactly one")


def test_neither_preset_nor_from_pretrained():
    assert _problems(smallest(model={}))["model"].startswith("neither model.preset nor model.from_pretrained")


def test_from_pretrained_directory_that_is_missing(tmp_path):
    missing = str(tmp_path / "nowhere")
    assert _problems(smallest(model={"from_pretrained": missing}))["model.from_pretrained"].startswith(
        f"{missing!r} does not exist"
    )


def test_from_pretrained_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert _problems(smallest(model={"from_pretrained": str(tmp_path)}))["model.from_pretrained"].startswith(
        f"{str(tmp_path)!r} has no config.json"
    )


def test_from_pretrained_adapter_directory_points_at_its_base(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base-7"}))
    message = _problems(smallest(model={"from_pretrained": str(tmp_path)}))["model.from_pretrained"]
    assert "holds a LoRA adapter (adapter_config.json), not a base model" in message
    assert "point model.from_pretrained at its base model ('/models/base-7'" in message


def test_unknown_keys_at_every_depth_all_in_one_error():
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict(smallest(optimiser={}, schedule={"stepz": 3}, lora={"r": 8, "alfa": 16}))
    problems = dict(caught.value.problems)
    assert set(problems) == {"optimiser", "schedule.stepz", "lora.alfa"}
    assert problems["optimiser"].startswith("unknown key; allowed keys are ['checkpoint', 'data', 'deepspeed',")
    assert problems["schedule.stepz"].endswith("did you mean 'steps'?")
    text = str(caught.value)
    assert text.startswith("recipe (from a dict): 3 problems\n") and "  schedule.stepz: unknown key;" in text


def test_model_config_problems_come_once_the_rest_is_valid():
    # checking an override key needs transformers (and so torch): the first pass reports what pydantic finds
    values = smallest(schedule={"stepz": 3}, model={"preset": "tiny", "overrides": {"hiden_size": 32}})
    assert set(_problems(values)) == {"schedule.stepz"}
    values["schedule"] = {}
    assert _problems(values) == {"model.overrides.hiden_size": "not a model config key; did you mean 'hidden_size'?"}


def test_the_model_type_the_recipe_spells_out_is_the_configs():
    from moe_plugin.config import HF_MODEL_TYPE

    assert HF_MODEL_TYPE == MoEPluginConfig.model_type


def test_an_invalid_override_value_names_overrides():
    message = _problems(smallest(model={"preset": "tiny", "overrides": {"num_experts_per_token": 0}}))[
        "model.overrides"
    ]
    assert message.startswith("the model config is invalid:") and "num_experts_per_token" in message


def test_cross_field_schedule_checks():
    problems = _problems(smallest(schedule={"steps": 10, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-2}))
    assert problems["schedule.min_lr"] == "0.01 is above schedule.lr (0.001); use a floor <= lr"
    assert problems["schedule.warmup_steps"].startswith("10 leaves no step after the warm-up")


def test_data_path_is_required_and_must_exist_for_files(tmp_path):
    assert _problems(smallest(data={"kind": "sft"}))["data.path"].startswith("is required when data.kind is 'sft'")
    missing = str(tmp_path / "chat.jsonl")
    assert _problems(smallest(data={"kind": "text", "path": missing}))["data.path"].startswith(
        f"{missing!r} does not exist"
    )
    (tmp_path / "chat.jsonl").write_text("")
    assert recipe_from_dict(smallest(data={"kind": "sft", "path": missing})).data.path == missing
    assert _problems(smallest(data={"kind": "literal"}))["data.kind"].startswith(
        'must be one of "arithmetic", "sft", "text", got \'literal\' (a str)'
    )


def test_output_dir_is_required_and_not_empty():
    assert _problems({"model": {"preset": "tiny"}})["output_dir"].startswith("is required;")
    assert _problems(smallest(output_dir=""))["output_dir"].startswith("is empty;")


def test_to_dict_round_trips_and_holds_every_section():
    recipe = recipe_from_dict(smallest(schedule={"steps": 7}, lora=None))
    values = recipe.to_dict()
    assert set(values) == {
        "output_dir",
        "seed",
        "deepspeed",
        "model",
        "lora",
        "data",
        "parallel",
        "schedule",
        "eval",
        "checkpoint",
        "logging",
        "guards",
        "router_balance",
    }
    assert values["schedule"]["steps"] == 7 and values["lora"] is None
    assert recipe_from_dict(json.loads(json.dumps(values))) == recipe


def test_load_recipe_names_the_file(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ValueError, match=f"recipe {missing}: cannot read it"):
        load_recipe(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "output_dir": "x",\n}\n')
    with pytest.raises(ValueError, match=f"recipe {broken}, line 3 column 1: not valid JSON"):
        load_recipe(str(broken))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(smallest(schedule={"steps": "10"})))
    with pytest.raises(RecipeError, match=f"recipe {bad}: schedule.steps: must be an integer"):
        load_recipe(str(bad))


def test_model_sources_and_configs(tmp_path):
    preset = recipe_from_dict(smallest(model={"preset": "tiny", "overrides": {"num_experts": 4}})).model
    assert preset.source_format() == "preset"
    assert preset.model_config() == preset_config("tiny", num_experts=4).to_model_config()

    hf = recipe_from_dict(smallest(model={"from_pretrained": SHIPPED_BASE, "overrides": {"num_experts_per_token": 1}}))
    with open(f"{SHIPPED_BASE}/config.json") as f:
        saved = json.load(f)
    assert hf.model.source_format() == "hf"
    built = hf.model.model_config()
    assert (built.moe.num_experts, built.moe.top_k, built.hidden_size) == (
        saved["num_experts"],
        1,
        saved["hidden_size"],
    )

    (tmp_path / "config.json").write_text(json.dumps(config_to_k3(preset_config("tiny"))))
    k3 = recipe_from_dict(smallest(model={"from_pretrained": str(tmp_path), "overrides": {"num_experts": 4}})).model
    assert k3.source_format() == "k3"
    expected = preset_config("tiny", vision_config=None, image_token_id=None, num_experts=4).to_model_config()
    assert k3.model_config() == expected
    assert type(k3).model_config["strict"] is True  # pydantic's settings are still there on the class


@pytest.fixture(scope="module")
def subword_init(tmp_path_factory):
    """What ``python -m examples.subword_base init`` writes: the start the pretrain recipe names
    (a clean clone has no ``outputs/``), built here as the README's first step builds it."""
    from examples.subword_base import write_init

    return write_init(str(tmp_path_factory.mktemp("subword") / "tiny-subword-init"))


def _shipped_recipe(recipe_path, subword_init):
    """The shipped recipe, with a start that a README step generates into ``outputs/`` pointed at one made
    here (every other field as shipped)."""
    values = json.load(open(recipe_path))
    if values["model"].get("from_pretrained") == "outputs/tiny-subword-init":
        values["model"]["from_pretrained"] = subword_init
    return recipe_from_dict(values, source=recipe_path)


@pytest.mark.parametrize("recipe_path", sorted(glob.glob("recipes/*.json")))
@pytest.mark.parametrize("ds_path", [None] + sorted(glob.glob("ds_configs/*.json")))
def test_shipped_recipes_and_ds_configs_load_and_merge(recipe_path, ds_path, subword_init):
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = _shipped_recipe(recipe_path, subword_init)
    recipe.model.model_config()
    recipe.deepspeed = ds_path
    ep, per_rank = (
        recipe.parallel.expert_parallel_size,
        recipe.schedule.micro_batch_size * recipe.schedule.gradient_accumulation_steps,
    )
    pinned = json.load(open(ds_path)).get("train_batch_size") if ds_path else None  # a config for one world
    worlds = [ep, 2 * ep, 4 * ep] if pinned is None else [pinned // per_rank]
    for world in worlds:
        check_layout(recipe, world, recipe.model.model_config().moe.num_experts)
        if pinned is not None and pinned != per_rank * world:
            with pytest.raises(ValueError, match="train_batch_size"):
                deepspeed_config(recipe, world)
            return
        merged = deepspeed_config(recipe, world)
        assert merged["train_batch_size"] == per_rank * world
    if pinned is not None or ep > 1:
        return  # DeepSpeed's parser below sees a world of one, which such a layout cannot be
    # DeepSpeed's own parser, outside a process group, sees a world of one
    parsed = DeepSpeedConfig(deepspeed_config(recipe, 1))
    assert parsed.train_micro_batch_size_per_gpu == recipe.schedule.micro_batch_size
    assert parsed.gradient_accumulation_steps == recipe.schedule.gradient_accumulation_steps


@pytest.mark.parametrize(
    "section, key, value, largest",
    [
        ("data", "seq_len", 10**30, "16,777,216"),
        ("data", "num_documents", 10**9, "1,000,000"),
        ("schedule", "steps", 10**20, "1,000,000,000"),
        ("schedule", "micro_batch_size", 10**6, "65,536"),
        ("schedule", "gradient_accumulation_steps", 10**6, "65,536"),
    ],
)
def test_absurd_sizes_are_refused_naming_the_field_and_the_largest(section, key, value, largest):
    """Before: seq_len 1e30 ended in an OverflowError traceback deep in the data pipeline, and steps 1e20 trained."""
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict(smallest(**{section: {key: value}}))
    message = str(caught.value)
    assert f"{section}.{key}: must be <=" in message and largest in message and "\n" not in message, message


def test_sharding_takes_zero3_or_fsdp2_and_fsdp2_refuses_what_it_does_not_run():
    """``parallel.sharding``: zero3 (the default) or fsdp2; FSDP2 runs on the megatron backend and without a
    DeepSpeed config, and each refusal names the field and the fix."""
    assert recipe_from_dict(smallest()).parallel.sharding == "zero3"
    assert recipe_from_dict(smallest(parallel={"sharding": "fsdp2"})).parallel.sharding == "fsdp2"
    assert _problems(smallest(parallel={"sharding": "fsdp"}))["parallel.sharding"].startswith("must be one of")
    message = _problems(smallest(parallel={"sharding": "fsdp2", "backend": "hf"}))["parallel.sharding"]
    assert "runs on the megatron backend" in message and 'sharding "zero3"' in message
    message = _problems(smallest(parallel={"sharding": "fsdp2"}, deepspeed="ds_configs/zero3_lora.json"))["deepspeed"]
    assert "parallel.sharding is 'fsdp2'" in message and 'remove "deepspeed"' in message
