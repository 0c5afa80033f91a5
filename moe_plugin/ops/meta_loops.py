"""Loops that run only their peak-setting steps on ``meta``.

The planner measures a layer by running it on meta (docs/planner.md, "Activations"): what matters there is what
the steps of a loop allocate, not their values. A blocked attention's query blocks or a packed expert layer's
groups each free what they make before the next step starts, and within a kind of step (the same shapes but
one size, such as a block's key span or a group's token rows) what a step makes grows with that size. So the
loop's peak is the peak of the largest step of each kind, and on meta only those need to run: a million-token
row has 16,384 attention blocks of 64 queries. Off meta every step runs. tests/plan/test_saved_bytes.py checks
each loop's meters against running every step.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, List, TypeVar

Step = TypeVar("Step")


def steps_to_run(
    steps: Iterable[Step], meta: bool, kind: Callable[[Step], Hashable], size: Callable[[Step], int]
) -> List[Step]:
    """``steps`` in order; on meta only the largest (by ``size``) of each ``kind``, in their order."""
    steps = list(steps)
    if not meta:
        return steps
    largest = {}
    for i, step in enumerate(steps):
        k, s = kind(step), size(step)
        if k not in largest or s > largest[k][0]:
            largest[k] = (s, i)
    return [steps[i] for i in sorted(i for _, i in largest.values())]
