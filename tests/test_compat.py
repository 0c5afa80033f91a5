"""moe_plugin.compat: each upstream's check() passes with the installed (pinned) versions and, with one upstream
name patched out, fails with one line naming that name, the installed version and the pin; the wrappers
behave as the reaches they replace; the product's start-up points run the checks; and ops.backend warns once
(or, with MOE_PLUGIN_REQUIRE_KERNELS=1, raises) when CUDA tensors miss the fla kernel, never for CPU tensors."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import warnings

import pytest
import torch

import moe_plugin.compat as compat
import moe_plugin.ops.backend as backend
from moe_plugin.compat import deepspeed as ds_compat
from moe_plugin.compat import fla as fla_compat
from moe_plugin.compat import megatron as mg_compat
from moe_plugin.compat import peft as peft_compat
from moe_plugin.compat import torch as torch_compat
from moe_plugin.compat import transformers as tf_compat

PINS = {
    "torch": ("torch", torch_compat.TESTED_TORCH),
    "deepspeed": ("deepspeed", ds_compat.TESTED_DEEPSPEED),
    "megatron": ("megatron-core", mg_compat.TESTED_MEGATRON),
    "peft": ("peft", peft_compat.TESTED_PEFT),
    "transformers": ("transformers", tf_compat.TESTED_TRANSFORMERS),
}


def test_pins_are_the_versions_setup_cfg_pins():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    for dist, pin in [*PINS.values(), (fla_compat.DISTRIBUTION, fla_compat.TESTED_FLA)]:
        assert f"{dist}=={pin}" in setup, dist


@pytest.mark.parametrize("name", compat.UPSTREAMS)
def test_every_check_passes_with_the_installed_versions(name):
    importlib.import_module(f"moe_plugin.compat.{name}").check()


def test_check_all_runs_each_once_and_refuses_an_unknown_name(monkeypatch):
    monkeypatch.setattr(compat, "_PASSED", set())
    compat.check_all()
    assert compat._PASSED == set(compat.UPSTREAMS)
    monkeypatch.setattr(tf_compat, "check", lambda: pytest.fail("a passed check ran again"))
    compat.check_all(("transformers",))
    with pytest.raises(ValueError, match=r"^upstreams: unknown compat module 'numpy'"):
        compat.check_all(("numpy",))


def _owner(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


# (compat module, upstream module, owner inside it, attribute deleted, the name the message must give)
MISSING = [
    (
        "deepspeed",
        "deepspeed.utils.groups",
        "",
        "_create_expert_and_data_parallel",
        "deepspeed.utils.groups._create_expert_and_data_parallel",
    ),
    (
        "deepspeed",
        "deepspeed.utils.groups",
        "",
        "_get_expert_data_parallel_group",
        "deepspeed.utils.groups._get_expert_data_parallel_group",
    ),
    (
        "deepspeed",
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
        "TorchCheckpointEngine",
        "load",
        "TorchCheckpointEngine.load",
    ),
    (
        "deepspeed",
        "deepspeed.runtime.zero.partition_parameters",
        "Init",
        "_convert_to_deepspeed_param",
        "deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param",
    ),
    (
        "megatron",
        "megatron.core.transformer.transformer_block",
        "",
        "TransformerBlock",
        "megatron.core.transformer.transformer_block.TransformerBlock",
    ),
    (
        "megatron",
        "megatron.core.tensor_parallel.mappings",
        "",
        "dist_all_gather_func",
        "megatron.core.tensor_parallel.mappings.dist_all_gather_func",
    ),
    (
        "peft",
        "peft.tuners.lora.layer",
        "ParamWrapper",
        "_activate_lora",
        "peft.tuners.lora.layer.ParamWrapper._activate_lora",
    ),
    (
        "peft",
        "peft.tuners.lora.config",
        "LoraConfig",
        "_register_custom_module",
        "peft.LoraConfig._register_custom_module",
    ),
    (
        "peft",
        "peft.tuners.tuners_utils",
        "BaseTuner",
        "_inject_parameters",
        "peft.tuners.tuners_utils.BaseTuner._inject_parameters",
    ),
    ("transformers", "transformers.trainer", "Trainer", "_save", "transformers.Trainer._save"),
    ("torch", "torch", "", "_grouped_mm", "torch._grouped_mm"),
    ("torch", "torch._C", "", "_dispatch_call_boxed", "torch._C._dispatch_call_boxed"),
    (
        "transformers",
        "transformers.utils.hub",
        "",
        "convert_file_size_to_int",
        "transformers.utils.hub.convert_file_size_to_int",
    ),
]


@pytest.mark.parametrize("name, module, owner, attr, shown", MISSING, ids=[m[-1] for m in MISSING])
def test_a_missing_upstream_name_is_one_line_naming_it_and_the_versions(monkeypatch, name, module, owner, attr, shown):
    monkeypatch.delattr(_owner(module, owner), attr)
    dist, pin = PINS[name]
    with pytest.raises(RuntimeError) as caught:
        importlib.import_module(f"moe_plugin.compat.{name}").check()
    message = str(caught.value)
    assert message.startswith(f"moe_plugin.compat.{name}: ") and shown in message, message
    assert f"in {dist} {importlib.metadata.version(dist)} (tested with {pin}); install {dist}=={pin}" in message
    assert "\n" not in message


def test_an_upstream_that_stopped_setting_an_attribute_is_named(monkeypatch):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from peft.tuners.tuners_utils import BaseTuner

    monkeypatch.setattr(MoELayer, "__init__", lambda self, *args, **kwargs: None)
    with pytest.raises(
        RuntimeError,
        match=r"^moe_plugin.compat.megatron: the router submodule assignment "
        r"'self.router = submodules.router\(' is no longer used by .*MoELayer",
    ):
        mg_compat.check()
    monkeypatch.setattr(BaseTuner, "_inject_parameters", lambda self, *args, **kwargs: None)
    with pytest.raises(
        RuntimeError,
        match=r"^moe_plugin.compat.peft: the class-name test .*ParamWrapper.* is no "
        r"longer used by peft.tuners.tuners_utils.BaseTuner._inject_parameters",
    ):
        peft_compat.check()


def test_fla_is_checked_only_where_installed_and_cuda_is_usable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fla_compat.check()  # CPU: nothing imported, nothing to check
    if importlib.util.find_spec("fla") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(fla_compat, "installed_version", lambda dist: "0.6.0")
        with pytest.raises(
            RuntimeError,
            match=r"^moe_plugin.compat.fla: fla.ops.kda cannot be imported.*"
            r"\(tested with 0.6.0\); install fla-core==0.6.0",
        ):
            fla_compat.check()


# --- the wrappers ---------------------------------------------------------------------------------------


def test_zero3_readers_fall_back_to_the_tensor_itself():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert not ds_compat.is_zero3_param(p) and not ds_compat.is_zero3_partitioned(p)
    assert ds_compat.full_shape(p) == (2, 3) and ds_compat.full_numel(p) == 6 and ds_compat.local_partition(p) is None
    p.data = torch.empty(0)  # as ZeRO-3 leaves it
    p.ds_id, p.ds_shape, p.ds_numel, p.ds_tensor = 7, torch.Size([2, 3]), 6, torch.ones(3)
    assert ds_compat.is_zero3_param(p) and ds_compat.is_zero3_partitioned(p)
    assert ds_compat.full_shape(p) == (2, 3) and ds_compat.full_numel(p) == 6
    assert ds_compat.local_partition(p) is p.ds_tensor
    ds_compat.tag_partition(p, "group", "ep_size_2", "autoep_expert")
    assert (p.ds_zero_partition_process_group, p.ds_zero_partition_group_name, p.ds_zero_placement_family) == (
        "group",
        "ep_size_2",
        "autoep_expert",
    )


def test_megatron_wrappers_refuse_what_megatron_did_not_build():
    class Base(torch.nn.Module):
        pass

    class Other(torch.nn.Module):
        pass

    class Sub(Base):
        def hello(self):
            return "sub"

    layer = Base()
    layer.router = torch.nn.Linear(2, 2)
    router = layer.router
    assert mg_compat.pop_router(layer) is router and "router" not in layer._modules
    with pytest.raises(
        RuntimeError,
        match=r"^moe_plugin.compat.megatron: .*MoELayer's submodule 'router' was not "
        r"registered in megatron-core 0.16.1 \(tested with 0.16.1\)",
    ):
        mg_compat.pop_router(layer)
    assert mg_compat.adopt_subclass(layer, Sub).hello() == "sub" and type(layer) is Sub
    with pytest.raises(
        RuntimeError,
        match=r"^moe_plugin.compat.megatron: Sub extends \['Base'\], but megatron-core "
        r"built a .*Other",
    ):
        mg_compat.adopt_subclass(Other(), Sub)


def test_packed_param_wrapper_is_peft_s_param_wrapper_by_name():
    from peft.tuners.lora.layer import ParamWrapper

    from moe_plugin.lora_packed import PackedParamWrapper

    assert issubclass(PackedParamWrapper, ParamWrapper) and PackedParamWrapper.__name__ == "ParamWrapper"


# --- the start-up points run the checks -------------------------------------------------------------------


def _refuse(*args, **kwargs):
    raise RuntimeError("moe_plugin.compat.test: refused")


def test_the_recipe_trainer_and_the_megatron_backend_check_first(monkeypatch):
    import moe_plugin.compat as compat_package
    import moe_plugin.training.loop as loop
    from moe_plugin.training.backends.megatron import MegatronBackend

    seen = []
    monkeypatch.setattr(loop, "check_all", lambda names: seen.append(tuple(names)) or _refuse())
    with pytest.raises(RuntimeError, match="refused"):
        loop.Trainer(recipe=None)  # nothing else is read before the check
    assert seen == [("torch", "deepspeed", "peft", "transformers")]
    monkeypatch.setattr(compat_package, "check_all", lambda names: seen.append(tuple(names)) or _refuse())
    backend_ = MegatronBackend.__new__(MegatronBackend)
    with pytest.raises(RuntimeError, match="refused"):
        backend_.setup_parallel()
    assert seen[-1] == ("megatron",)


def test_the_hf_trainer_wrapper_checks_at_construction(monkeypatch, tmp_path):
    import moe_plugin.hf_trainer as hf_trainer

    seen = []
    monkeypatch.setattr(hf_trainer, "check_all", lambda names: seen.append(tuple(names)) or _refuse())
    with pytest.raises(RuntimeError, match="refused"):
        hf_trainer.MoETrainer(model=torch.nn.Linear(2, 2))
    assert seen == [("torch", "transformers", "peft")]


# --- fla: the one kernel choice ---------------------------------------------------------------------------


@pytest.fixture
def no_kernel(monkeypatch):
    """CUDA tensors as far as the choice can tell, and an fla kernel that does not import."""
    monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)
    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: None)
    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.delenv("MOE_PLUGIN_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("MOE_PLUGIN_REQUIRE_KERNELS", raising=False)
    return monkeypatch


def _kda_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    g = -torch.rand(1, 8, 2, 4)
    beta = torch.rand(1, 8, 2)
    return q, k, v, g, beta


def test_cuda_tensors_without_the_fla_kernel_warn_once(no_kernel):
    from moe_plugin.ops.kda.chunk import chunk_kda

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, _ = chunk_kda(*_kda_inputs())  # the torch path still runs
        chunk_kda(*_kda_inputs())
    missing = [w for w in caught if "moe_plugin.compat.fla" in str(w.message)]
    assert len(missing) == 1, [str(w.message) for w in caught]
    message = str(missing[0].message)
    assert missing[0].category is RuntimeWarning and "\n" not in message
    assert "fla.ops.kda.chunk_kda" in message and "fla-core==0.6.0" in message and "35-90x slower" in message
    assert "MOE_PLUGIN_REQUIRE_KERNELS=1" in message and torch.isfinite(first).all()


def test_require_kernels_makes_it_an_error(no_kernel):
    from moe_plugin.ops.kda.chunk import chunk_kda

    no_kernel.setenv("MOE_PLUGIN_REQUIRE_KERNELS", "1")
    with pytest.raises(
        RuntimeError,
        match=r"^moe_plugin.compat.fla: CUDA tensors reached fla.ops.kda.chunk_kda, "
        r"which does not import.*35-90x slower; install fla-core==0.6.0",
    ):
        chunk_kda(*_kda_inputs())


def test_cpu_tensors_and_disabled_kernels_never_warn(monkeypatch):
    from moe_plugin.ops.kda.chunk import chunk_kda

    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: None)
    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.setenv("MOE_PLUGIN_REQUIRE_KERNELS", "1")  # would raise, were anything to be said
    monkeypatch.delenv("MOE_PLUGIN_DISABLE_KERNELS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.gpu_kernel("fla.ops.kda", "chunk_kda", torch.zeros(2)) is None  # the real device test
        chunk_kda(*_kda_inputs())
        monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)
        monkeypatch.setenv("MOE_PLUGIN_DISABLE_KERNELS", "1")  # the torch path on purpose
        assert backend.gpu_kernel("fla.ops.kda", "chunk_kda", torch.zeros(2)) is None


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed here")
def test_the_real_failed_import_is_the_reason_given(monkeypatch):
    monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)
    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.delenv("MOE_PLUGIN_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("MOE_PLUGIN_REQUIRE_KERNELS", raising=False)
    with pytest.warns(
        RuntimeWarning,
        match=r"fla.ops.kda.chunk_kda, which does not import with fla-core \(not "
        r"installed\) \(ModuleNotFoundError: No module named 'fla'\)",
    ):
        assert backend.gpu_kernel("fla.ops.kda", "chunk_kda", torch.zeros(2)) is None


def test_quiet_wrapping_hides_only_pefts_deprecated_flag_read():
    import warnings

    from moe_plugin.compat.peft import quiet_wrapping

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_wrapping():
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else"]
