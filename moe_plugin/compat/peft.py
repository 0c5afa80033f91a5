"""Every reach into peft's internals (tested with peft 0.21.2, the pin of setup.cfg).

``moe_plugin.lora_packed.PackedParamWrapper`` is a subclass of peft's ``ParamWrapper`` (the LoRA layer of
``target_parameters``) that overrides its private hooks, so an adapter over packed experts keeps peft's own
layout: ``_get_in_out_features`` (called by ``LoraLayer.__init__``; it sets ``_param_ndim``, which
``update_layer`` reads), ``_move_adapter_to_device_of_base_layer`` (called by ``update_layer``) and
``_activate_lora`` (entered by ``forward``). Two more peft privates make it usable:

* ``LoraConfig._register_custom_module`` makes peft build that layer for ``PackedStackedExperts``
  (``register_custom_module``);
* ``BaseTuner._inject_parameters`` recognises a parameter wrapper by its class *name*, ``"ParamWrapper"`` (it
  nests a second targeted parameter only inside one), so the subclass carries that name
  (``named_as_param_wrapper``).

``check()`` verifies each of those names once at start-up (``moe_plugin.compat.check_all``).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

from ._upstream import missing, require_in_source, resolve

__all__ = [
    "TESTED_PEFT",
    "check",
    "param_wrapper_base",
    "named_as_param_wrapper",
    "quiet_wrapping",
    "register_custom_module",
]

TESTED_PEFT = "0.21.2"
_DIST = "peft"
_LAYER = "peft.tuners.lora.layer"
_WRAPPER = "ParamWrapper"
# ParamWrapper's own methods PackedParamWrapper overrides (an override of a method peft no longer has, or
# inherits from elsewhere, would silently never run)
_OVERRIDDEN = ("_get_in_out_features", "_move_adapter_to_device_of_base_layer", "_activate_lora", "merge")
# what PackedParamWrapper calls or reads on itself
_USED = ("get_param", "get_base_layer", "update_layer", "adapter_layer_names")
_INJECT = ("peft.tuners.tuners_utils", "BaseTuner._inject_parameters")


def _resolve(module: str, attr: str = ""):
    return resolve("peft", _DIST, TESTED_PEFT, module, attr)


def param_wrapper_base() -> type:
    """peft's ``ParamWrapper`` class, to subclass."""
    return _resolve(_LAYER, _WRAPPER)


def named_as_param_wrapper(cls: type) -> type:
    """Give ``cls`` (a ``ParamWrapper`` subclass) the class name peft's ``_inject_parameters`` looks for."""
    cls.__name__ = _WRAPPER
    return cls


def register_custom_module(config, mapping) -> None:
    """Make peft build ``mapping[type(module)]`` as the LoRA layer of such modules (``LoraConfig``'s private
    ``_register_custom_module``)."""
    _resolve("peft", "LoraConfig._register_custom_module")
    config._register_custom_module(mapping)


@contextmanager
def quiet_wrapping() -> Iterator[None]:
    """Around a ``get_peft_model`` or ``PeftModel.from_pretrained`` of ours: peft 0.21 reads transformers'
    deprecated ``is_gradient_checkpointing`` while it wraps a model, a FutureWarning on every wrapping that says
    nothing about the run; only that warning is hidden, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def check() -> None:
    """Every peft name this module and ``lora_packed`` use exists in the installed peft (RuntimeError naming the
    first that does not, the installed version and ``TESTED_PEFT``)."""
    wrapper = param_wrapper_base()
    for name in _OVERRIDDEN:
        if not callable(vars(wrapper).get(name)):
            raise missing("peft", _DIST, TESTED_PEFT, f"{_LAYER}.{_WRAPPER}.{name}")
    for name in _USED:
        _resolve(_LAYER, f"{_WRAPPER}.{name}")
    require_in_source(
        "peft",
        _DIST,
        TESTED_PEFT,
        wrapper.update_layer,
        f"{_LAYER}.{_WRAPPER}.update_layer",
        ("_param_ndim", "_move_adapter_to_device_of_base_layer"),
        "the ParamWrapper hook",
    )
    lora_layer = _resolve(_LAYER, "LoraLayer")
    require_in_source(
        "peft",
        _DIST,
        TESTED_PEFT,
        lora_layer.__init__,
        f"{_LAYER}.LoraLayer.__init__",
        ("self._get_in_out_features(",),
        "the ParamWrapper hook",
    )
    require_in_source(
        "peft",
        _DIST,
        TESTED_PEFT,
        wrapper.forward,
        f"{_LAYER}.{_WRAPPER}.forward",
        ("_activate_lora",),
        "the ParamWrapper hook",
    )
    _resolve("peft", "LoraConfig._register_custom_module")
    inject = _resolve(*_INJECT)
    require_in_source(
        "peft", _DIST, TESTED_PEFT, inject, ".".join(_INJECT), ('__name__ == "ParamWrapper"',), "the class-name test"
    )
