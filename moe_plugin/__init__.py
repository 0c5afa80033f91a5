"""moe_plugin: LoRA fine-tuning of ultra-large mixture-of-experts models (Stable Latent MoE, KDA + Gated DSA).

``import moe_plugin`` is light (no torch, no transformers), so the commands can refuse a bad input before the
heavy libraries load. The model classes are registered with transformers' Auto classes as soon as both
``moe_plugin`` and ``transformers`` are imported, in either order: at once when transformers is already
loaded, else right after transformers' own import (a one-shot import hook). Touching an exported name
(``moe_plugin.MoEPluginForCausalLM``) or importing ``moe_plugin.models`` registers too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"
__all__ = [
    "MoEPluginConfig",
    "MoEPluginForCausalLM",
    "MoEPluginForConditionalGeneration",
    "MoEProcessor",
    "preset_config",
    "__version__",
]

_FROM_MODELS = frozenset(__all__) - {"__version__"}


def __getattr__(name: str):
    if name in _FROM_MODELS:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'moe_plugin' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _FROM_MODELS)


def _register() -> None:
    try:
        importlib.import_module("moe_plugin.models")  # registers on import (moe_plugin/models/__init__.py)
    except ImportError:
        # transformers without torch: the model classes cannot exist, and AutoModel could not build them anyway
        pass


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets the normal finder locate ``transformers`` and runs the registration once
    that module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module  # on this spec's own loader instance only
        return spec


if sys.modules.get("transformers") is not None:
    _register()
elif not any(isinstance(f, _RegisterAfterTransformers) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterTransformers())
