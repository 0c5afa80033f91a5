"""LoRA on packed routed experts through peft's ``target_parameters``, in peft's own adapter layout.

peft's ``ParamWrapper`` (what ``target_parameters=["experts.w1", ...]`` creates) reaches the parameter with
``getattr(base_layer, "w1")``, sizes its adapters from that tensor's shape, and applies them by registering a
``torch.nn.utils.parametrize`` on it that returns ``W + scaling * B A`` for the duration of the forward. Over a
packed base none of that can work: the tensor is integer codes of another shape, and the parametrization
would build (and autograd would keep for backward) a dense copy of the whole expert stack, which is exactly
what packed experts avoid.

So ``PackedParamWrapper`` is a ``ParamWrapper`` subclass, registered with peft as the custom LoRA layer for
``PackedStackedExperts`` (``LoraConfig._register_custom_module``, done by ``moe_plugin.lora.lora_config``). It
keeps everything peft saves and loads (``lora_A [r * E, in]``, ``lora_B [out, r * E]`` per expert kind, the
layout of ``moe_plugin.expert_adapters``, whose ``split_factors`` hands them to the packed layer; the
nesting of one wrapper per targeted parameter, the adapter config), so an adapter trained over the packed
base loads with plain peft onto the BF16 model and back. It changes two things: the in/out sizes come from
the layer's logical shapes, and the forward hands the adapters to the packed layer (``active_lora``), which
applies them on the activation side, ``scaling * (x A_e^T) B_e^T``, equal to adding ``scaling * B_e A_e`` to
expert e's weight. Merging into the packed base is refused: it is a lossy requantisation, done on purpose by
``moe_plugin.weights.quantize``.
"""

from __future__ import annotations

import contextlib
from typing import Any, List

from .compat.peft import named_as_param_wrapper, param_wrapper_base
from .expert_adapters import split_factors
from .layers.packed_experts import PackedStackedExperts

__all__ = ["PackedParamWrapper"]


# peft recognises its parameter wrappers by class name (tuners_utils' _inject_parameters nests a second
# targeted parameter only inside a class named "ParamWrapper"), so the subclass carries that name
@named_as_param_wrapper
class PackedParamWrapper(param_wrapper_base()):
    """peft's ``ParamWrapper`` over a ``PackedStackedExperts`` parameter (see the module docstring)."""

    def _get_in_out_features(self, module):
        base = self.get_base_layer()
        if not isinstance(base, PackedStackedExperts):
            raise ValueError(
                f"{self.parameter_name}: PackedParamWrapper wraps PackedStackedExperts only, got {type(base).__name__}"
            )
        e, out, inp = base.logical_shapes[self.parameter_name]
        self.num_experts, self._param_ndim = e, 3
        # ParamWrapper.update_layer swaps them for an untransposed 3-D stack, giving in = inp, out = out
        return out, inp

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        # the adapters stay in their own (floating) dtype on the packed base's device
        param = self.get_param()
        for layer_name in self.adapter_layer_names:
            layer = getattr(self, layer_name, None)
            if layer is not None and adapter_name in layer and param.device.type != "meta":
                layer[adapter_name] = layer[adapter_name].to(param.device)

    @contextlib.contextmanager
    def _activate_lora(self, active_adapters: List[str]):
        adapters = [a for a in active_adapters if a in self.lora_A]
        if not adapters:
            yield
            return
        base = self.get_base_layer()
        entries = [
            (*split_factors(self.lora_A[a].weight, self.lora_B[a].weight, self.num_experts), self.scaling[a])
            for a in adapters
        ]
        base.active_lora.setdefault(self.parameter_name, []).extend(entries)
        try:
            yield
        finally:
            kept = base.active_lora[self.parameter_name][: -len(entries)]
            if kept:
                base.active_lora[self.parameter_name] = kept
            else:
                del base.active_lora[self.parameter_name]

    def merge(self, safe_merge: bool = False, adapter_names: Any = None) -> None:
        raise ValueError(
            f"{self.parameter_name}: the packed experts cannot take a merged adapter in place (that "
            "would requantise them, a lossy change); export with "
            "moe_plugin.weights.quantize.merge_expert_adapter instead"
        )
