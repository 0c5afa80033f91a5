"""Tolerances of the "N processes equal one process" tests, derived from fp32 error bounds.

Why the runs differ at all: both do the same math on the same rows, in float32, with one thread per process
(``run_distributed`` sets it), so each run is bitwise repeatable on its machine, loaded or not. Between layouts
only the order of the sums changes: one process sums a weight gradient over all T tokens inside one matmul,
N processes sum T/N tokens each and the all-reduce adds the partial sums; the GEMM kernels also block a
[T, h] batch differently from a [T/N, h] one. How far two orders drift apart depends on the CPU's kernels, so
a tolerance read off one machine's run fails on another: each bound here comes from the arithmetic instead.

The model of the error, step by step (``U`` is float32's unit roundoff, 2**-24):

1. A sum of n terms in any order is within ``gamma(n - 1) * sum|x_i|`` of the exact sum, ``gamma(n) =
   n U / (1 - n U)`` (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2); two orders
   differ by twice that. For non-negative terms (token losses) ``sum|x_i|`` is the sum itself: ``sum_rel``.
2. A quantity made by a chain of such sums (a gradient element: the token sum of products that each came
   through the forward and backward of every layer) carries the errors of every sum in the chain. Rounding
   errors of round-to-nearest behave as independent steps of at most U, so over ``n`` terms in all they add
   to about ``U * sqrt(n)``; ``chain_rel`` allows ``SAFETY`` (10) times that. The worst-case ``gamma(n)`` for
   the same chain (about 5e-4 here) would hide one rank's loss off by one part in a thousand. Relative to the
   largest element of the tensor, which stands in for the unobservable ``sum|terms|`` of every element.
3. Step 1 starts from the same parameters in both runs, so its loss, gradients and gradient norm differ by
   rounding alone (1 and 2). From there on the parameters differ by what AdamW made of those differences.
4. AdamW divides each element by its own gradient scale: ``u = m_hat / (sqrt(v_hat) + eps)``. If every
   gradient the element has seen moves by at most a fraction ``rho`` of itself, ``u`` moves by at most
   ``2 rho / (1 - rho) * B_t`` (the numerator by ``rho`` of ``sum a_s |g_s|``, the denominator by a factor
   ``1 +- rho``; eps only damps it), where ``B_t = sqrt(sum a_s**2 / b_s)`` bounds ``|u|`` at step t by
   Cauchy-Schwarz over the bias-corrected weights ``a_s`` of m and ``b_s`` of v; never by more than ``2 B_t``.
   An element whose gradient is within rounding of zero can thus move by up to ``2 lr`` against the other
   run, while a well-determined one moves by ``lr`` times its relative error: the bound is elementwise
   (``adam_step_bound``). Clipping scales a step's gradient by ``max_norm / norm``; the two runs' factors
   differ by their norms' relative difference, which adds to every ``rho`` of that step.
5. At step s > 1 the runs differ by the parameter difference d (checked by 4 against the gradients both
   runs saw). The loss moves by at most ``sum_j |g_j| |d_j|`` to first order (``FIRST_ORDER`` doubles it for
   the remainder). The gradient moves by ``H d``: a training step at these learning rates changes the gradient
   by at most its own size, so a parameter difference that is a fraction f of the distance the parameters
   have travelled moves the gradient by at most ``SAFETY * f`` of its largest element (``gradient_bound``).

``check_run`` compares one run (``got``) with the one-process reference (``ref``), both dicts of per-step
``losses``, ``grad_norms``, ``step_grads`` (the reduced gradient before clipping, PEFT names) and ``adapters``
(before the first step and after each), as tests/training/trainer_workers.py records them; it returns what is
out of bounds, one line each. Both runs are checked against the same bounds whatever the machine: the
mutation of scaling one of two ranks' losses by 1.001 fails step 1 by 7x (the loss) to 19x (a gradient).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

U = 2.0**-24  # float32 unit roundoff (half of torch.finfo(torch.float32).eps)
SAFETY = 10.0  # multiple of the statistical rounding error allowed (2 above); also the gradient's sensitivity (5)
FIRST_ORDER = 2.0  # room for the second-order remainder of a first-order propagation (5)
BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which the trainer uses
UPDATE_OPS = 16  # fp32 operations of one AdamW element update (moments, bias corrections, sqrt, divide, add)


def gamma(n: int) -> float:
    """Higham's gamma_n = n U / (1 - n U): the relative error bound of a chain of n fp32 roundings."""
    if n * U >= 1:
        raise ValueError(f"n: {n} roundings exceed what gamma_n bounds in fp32; use a shorter reduction")
    return n * U / (1 - n * U)


def sum_rel(n: int) -> float:
    """Two fp32 sums of the same n non-negative terms, in any orders, differ by at most this times the sum."""
    return 2 * gamma(max(n - 1, 1))


def chain_length(tokens: int, layers: int, width: int, vocab: int) -> int:
    """Terms in the longest chain of sums behind one gradient element: the token sum, the softmax over the
    vocabulary, and per layer forward and backward 16 contractions (attention's projections and scores, the
    indexer, the router, the experts' up and down) of at most ``width`` terms (the largest of the hidden size,
    the MLP's intermediate size and the sequence length)."""
    return tokens + vocab + 16 * layers * width


def chain_rel(n: int, safety: float = SAFETY) -> float:
    """Relative difference two evaluations of an n-term chain of fp32 sums may show (module doc, 2)."""
    return safety * U * math.sqrt(n)


def adam_ratio_bound(step: int, betas=BETAS) -> float:
    """B_t: the largest |m_hat / sqrt(v_hat)| AdamW can reach at ``step`` (1-based), whatever the gradients."""
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (step - s) / (1 - b1**step) for s in range(1, step + 1)]
    b = [(1 - b2) * b2 ** (step - s) / (1 - b2**step) for s in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adam_step_bound(rho: torch.Tensor, step: int, lr: float) -> torch.Tensor:
    """Elementwise bound on how far one AdamW step of two runs apart, when every gradient either run's element
    has seen differs by at most the fraction ``rho`` of itself (inf: unknown sign); module doc, 4."""
    bound_u = adam_ratio_bound(step)
    r = rho.clamp(max=0.5)
    moved = torch.where(rho < 0.5, 2 * r / (1 - r) * bound_u, torch.full_like(rho, 2 * bound_u))
    return lr * (moved + gamma(UPDATE_OPS) * bound_u)


def _relative_change(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """|got - ref| / |ref| elementwise; 0 where they are equal (both zero included), inf where only ref is zero."""
    diff = (got - ref).abs()
    out = diff / ref.abs()
    return torch.where(diff == 0, torch.zeros_like(out), out)


def _clip_factor(norm: float, max_norm) -> float:
    return 1.0 if not max_norm else min(1.0, max_norm / (norm + 1e-6))


def gradient_bound(ref_grad: torch.Tensor, rel: float, drift: float, global_max: float) -> float:
    """Largest allowed |got - ref| in one gradient tensor: rounding (``rel`` of its largest element) plus the
    parameter drift's effect (``SAFETY * drift`` of the largest gradient element of the model); module doc, 5."""
    return rel * float(ref_grad.abs().max()) + SAFETY * drift * global_max


def check_run(
    ref: dict, got: dict, *, tokens: int, chain: int, lr: float, max_norm=None, min_tight: float = 0.8
) -> List[str]:
    """Every bound of the module doc, step by step: losses, gradient norms, every gradient element and every
    adapter element after each step. ``tokens``: label tokens of a step's global batch; ``chain``:
    ``chain_length(...)`` of the model; ``lr``: the largest learning rate of the steps; ``max_norm``: the
    recipe's ``clip_grad_norm``. ``adapters`` holds the adapter before the first step and after each.
    ``min_tight``: the fraction of adapter elements whose final bound must stay under a tenth of one step
    (``lr``), so that the adapter check has teeth."""
    out: List[str] = []
    steps = len(ref["losses"])
    if not (
        len(got["losses"])
        == len(ref["step_grads"])
        == len(got["step_grads"])
        == steps
        == len(ref["adapters"]) - 1
        == len(got["adapters"]) - 1
    ):
        return [f"steps: got {len(got['losses'])} losses and {len(got['step_grads'])} gradients, ref {steps}"]
    if sorted(got["step_grads"][0]) != sorted(ref["step_grads"][0]):
        return ["gradient names differ"]
    rel = chain_rel(chain)
    names = sorted(ref["step_grads"][0])
    rho = {n: torch.zeros_like(ref["step_grads"][0][n]) for n in names}
    apart = {n: (got["adapters"][0][n] - ref["adapters"][0][n]).abs() for n in names}
    if any(bool(d.any()) for d in apart.values()):
        return ["the adapters differ before the first step (same seed, same initialisation expected)"]
    for s in range(steps):
        g_ref, g_got = ref["step_grads"][s], got["step_grads"][s]
        # 5: how far apart the runs' parameters are before this step, against how far they have travelled
        travelled = _norm(ref["adapters"][s][n] - ref["adapters"][0][n] for n in names)
        drift = _norm(apart.values()) / travelled if travelled > 0 else 0.0  # step 1: apart is zero
        global_max = max(float(g.abs().max()) for g in g_ref.values())
        first_order = sum(float((g_ref[n].abs() * apart[n]).sum()) for n in names)
        loss_bound = (sum_rel(tokens) + rel) * abs(ref["losses"][s]) + FIRST_ORDER * first_order
        if not abs(got["losses"][s] - ref["losses"][s]) <= loss_bound:
            out.append(f"step {s + 1} loss: {got['losses'][s]!r} vs {ref['losses'][s]!r}, bound {loss_bound:.3g}")
        squared = 0.0
        for n in names:
            bound = gradient_bound(g_ref[n], rel, drift, global_max)
            squared += bound * bound * g_ref[n].numel()
            err = float((g_got[n] - g_ref[n]).abs().max())
            if not err <= bound:
                out.append(f"step {s + 1} gradient {n}: max |diff| {err:.3g} > bound {bound:.3g}")
        norm_ref, norm_got = ref["grad_norms"][s], got["grad_norms"][s]
        norm_bound = math.sqrt(squared) + sum_rel(sum(g.numel() for g in g_ref.values())) * norm_ref
        if not abs(norm_got - norm_ref) <= norm_bound:
            out.append(f"step {s + 1} gradient norm: {norm_got!r} vs {norm_ref!r}, bound {norm_bound:.3g}")
        # 4: the optimizer step, from the gradients both runs had (each bounded above)
        c_ref, c_got = _clip_factor(norm_ref, max_norm), _clip_factor(norm_got, max_norm)
        tight = total = 0
        for n in names:
            rho[n] = torch.maximum(rho[n], _relative_change(c_ref * g_ref[n], c_got * g_got[n]))
            a_ref, a_got = ref["adapters"][s + 1][n], got["adapters"][s + 1][n]
            bound = apart[n] + adam_step_bound(rho[n], s + 1, lr) + 2 * gamma(2) * a_ref.abs()
            diff = (a_got - a_ref).abs()
            if bool((diff > bound).any()):
                i = int((diff - bound).argmax())
                out.append(
                    f"step {s + 1} adapter {n}: element {i} differs by {float(diff.flatten()[i]):.3g} "
                    f"> bound {float(bound.flatten()[i]):.3g}"
                )
            tight += int((bound < 0.1 * lr).sum())
            total += bound.numel()
            apart[n] = diff
    if tight < min_tight * total:
        out.append(f"premise: only {tight} of {total} adapter elements are bounded within a tenth of a step")
    return out


def check_final_adapters(
    ref: Dict[str, torch.Tensor],
    got: Dict[str, torch.Tensor],
    *,
    steps: int,
    lr: float,
    loose_share: float = 0.01,
    tight_steps: float = 0.01,
) -> List[str]:
    """For runs that record only their final adapters (the Hugging Face Trainer's): without the step gradients
    ``check_run`` needs, each element is held to the worst case of ``steps`` AdamW steps apart (at most
    ``2 B_t lr`` a step whatever the gradients, module doc 4), and all but ``loose_share`` of each tensor's
    elements to ``tight_steps`` of one step (``lr``). A well-determined element drifts by ``lr`` times its
    gradient's relative rounding a step, orders of magnitude below that; only an element whose gradient sits
    within rounding of zero may use the worst case, and those are a few in a trained adapter."""
    out: List[str] = []
    worst = sum(2 * adam_ratio_bound(s) * lr + gamma(UPDATE_OPS) * lr for s in range(1, steps + 1))
    if sorted(ref) != sorted(got):
        return ["adapter names differ"]
    for name in sorted(ref):
        diff = (got[name].double() - ref[name].double()).abs()
        if float(diff.max()) > worst:
            out.append(f"{name}: max |diff| {float(diff.max()):.3g} > the worst case of {steps} steps {worst:.3g}")
        loose = int((diff > tight_steps * lr).sum())
        if loose > loose_share * diff.numel():
            out.append(
                f"{name}: {loose} of {diff.numel()} elements differ by more than {tight_steps} of a step "
                f"({tight_steps * lr:.3g}); at most {loose_share:.0%} may"
            )
    return out


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))
