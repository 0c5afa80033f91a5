"""The Hugging Face faces take a ``ContextSlice`` (context parallelism on the hf backend): on a one-rank context
the forward through the context path equals the packed forward, and the loss the backends compose from it
(``training_loss(..., context=)``) equals the model's own; bad combinations are refused by name. Several ranks:
tests/training/test_context_parallel_trainer.py (the hf backend at CP 2 x EP 2 equals one process)."""

from __future__ import annotations

import pytest
import torch

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM
from moe_plugin.ops.losses import training_loss
from moe_plugin.training.data.pipeline import label_token_count
from tests.context_cases import alone

OFFSETS = (0, 5, 17, 24)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEPluginForCausalLM(moe_plugin.preset_config("tiny")).train()


def test_the_context_path_equals_the_packed_forward(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, OFFSETS[-1]), generator=gen)
    labels = ids.clone()
    labels[0, 9] = -100
    cu = torch.tensor(OFFSETS)
    items = label_token_count(labels, cu)
    packed = model(input_ids=ids, labels=labels, cu_seqlens=cu, num_items_in_batch=items)
    sliced = model(input_ids=ids, context=alone(OFFSETS[-1], OFFSETS))
    assert torch.allclose(sliced.logits, packed.logits, atol=1e-6, rtol=0)
    assert packed.indexer_loss is not None and torch.allclose(sliced.indexer_loss, packed.indexer_loss, atol=1e-7)
    composed = training_loss(
        sliced.logits,
        labels,
        cu,
        items,
        sliced.indexer_loss,
        model.config.indexer_loss_coeff,
        context=alone(OFFSETS[-1], OFFSETS),
    )
    assert torch.allclose(composed, packed.loss, atol=1e-6, rtol=0)


def test_a_context_refuses_what_it_replaces(model):
    ids = torch.zeros(1, 8, dtype=torch.long)
    context = alone(8, (0, 3, 8))
    with pytest.raises(ValueError, match="labels: cannot be combined with a context"):
        model(input_ids=ids, labels=ids, context=context)
    with pytest.raises(ValueError, match="cu_seqlens: cannot be combined with a context"):
        model(input_ids=ids, cu_seqlens=torch.tensor([0, 8]), context=context)
    with pytest.raises(ValueError, match="attention_mask: cannot be combined with a context"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]), context=context)
