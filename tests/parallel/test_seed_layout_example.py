"""``examples/seed_layout.py`` as its docstring launches it: the seed's FSDP2 x expert-parallel layout with LoRA on
4 CPU processes under torchrun trains (the loss falls) and every rank ends with the same sharded adapters."""

from __future__ import annotations

import re

import pytest

from tests.training.launchers import launch, torchrun


@pytest.mark.slow
@pytest.mark.distributed
def test_seed_layout_example_trains_one_adapter_on_four_processes():
    out = launch(torchrun(4, "examples/seed_layout.py"), timeout=600)
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 5, out[-3000:]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    check = "18 adapter tensors sharded, trained as one, identical on all ranks: True"
    assert check in out.splitlines(), out[-3000:]
