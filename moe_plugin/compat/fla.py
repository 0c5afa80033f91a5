"""flash-linear-attention (``fla``, the ``fla-core`` distribution; tested with 0.6.0, the ``gpu`` extra of
setup.cfg): the Triton kernels the KDA attention uses on CUDA tensors.

``moe_plugin.ops.backend.gpu_kernel`` is the one place that picks them: when CUDA tensors arrive and the
kernel does not import it warns once (``missing_kernel_message``: the torch path runs, 35-90x slower), and
with ``MOE_PLUGIN_REQUIRE_KERNELS=1`` it raises instead. CPU tensors always take the torch path, which is the
intended one there, so nothing is said. fla is optional: ``check()`` verifies the kernel names only where fla
is installed and CUDA is usable (its import looks for a GPU driver).
"""

from __future__ import annotations

from ._upstream import installed_version, resolve

__all__ = ["TESTED_FLA", "DISTRIBUTION", "KERNELS", "REQUIRE_ENV", "check", "missing_kernel_message"]

TESTED_FLA = "0.6.0"
DISTRIBUTION = "fla-core"
# (module, function) of every fla kernel moe_plugin calls
KERNELS = (("fla.ops.kda", "chunk_kda"),)
REQUIRE_ENV = "MOE_PLUGIN_REQUIRE_KERNELS"


def missing_kernel_message(module: str, attr: str, reason: str = "") -> str:
    """One line: CUDA tensors reached ``module.attr``, which did not import, so the torch path runs."""
    because = f" ({reason})" if reason else ""
    return (
        f"moe_plugin.compat.fla: CUDA tensors reached {module}.{attr}, which does not import with "
        f"{DISTRIBUTION} {installed_version(DISTRIBUTION)}{because}: the torch path runs instead, 35-90x slower; "
        f"install {DISTRIBUTION}=={TESTED_FLA} (pip install 'moe_plugin[gpu]'), or set {REQUIRE_ENV}=1 to make "
        "this an error"
    )


def check() -> None:
    """Where fla is installed and CUDA is usable, every kernel of ``KERNELS`` exists (RuntimeError naming it, the
    installed version and ``TESTED_FLA``); elsewhere nothing to check (the torch path is used)."""
    import torch

    if installed_version(DISTRIBUTION) == "(not installed)" or not torch.cuda.is_available():
        return
    for module, attr in KERNELS:
        resolve("fla", DISTRIBUTION, TESTED_FLA, module, attr)
