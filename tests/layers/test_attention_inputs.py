"""The one description of a forward's token layout (layers/attention_inputs.py): each mode, every combination no
mode allows refused by name, in one place; a layer handed the model's description refuses it given twice, and
both attention kinds give the same output from the description as from their keyword arguments."""

from __future__ import annotations

import pytest
import torch

import moe_plugin
from moe_plugin.layers.attention_inputs import describe_inputs
from moe_plugin.layers.decoder import DecoderLayer
from tests.context_cases import alone

CU = torch.tensor([0, 3, 8])
MASK = torch.tensor([[False, True, True, True, True, True, True, True]])


def test_each_mode():
    assert describe_inputs(2, 8).mode == "rows"
    assert describe_inputs(1, 8, cu_seqlens=CU).mode == "packed"
    padded = describe_inputs(1, 8, token_mask=MASK.int())
    assert padded.mode == "padded" and padded.token_mask.dtype == torch.bool
    assert describe_inputs(1, 8, context=alone(8, (0, 3, 8))).mode == "context"
    assert describe_inputs(1, 8, token_mask=MASK, decoding=True).decoding


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(cu_seqlens=CU, decoding=True), "cu_seqlens"),
        (dict(cu_seqlens=CU, token_mask=MASK), "token_mask"),
        (dict(context=alone(8, (0, 3, 8)), cu_seqlens=CU), "cu_seqlens"),
        (dict(context=alone(8, (0, 3, 8)), token_mask=MASK), "token_mask"),
        (dict(context=alone(8, (0, 3, 8)), decoding=True), "cache"),
        (dict(context=alone(16)), "hidden_states"),
        (dict(token_mask=MASK[:, :4]), "token_mask"),
    ],
)
def test_combinations_no_mode_allows_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        describe_inputs(1, 8, **kwargs)


@pytest.mark.parametrize("index", [0, 3])  # the tiny preset: KDA first, gated MLA last
def test_a_layer_reads_the_description_as_its_keyword_arguments(index):
    torch.manual_seed(0)
    config = moe_plugin.preset_config("tiny").to_model_config()
    layer = DecoderLayer(config, index).eval()
    attn = layer.self_attn
    h = torch.randn(1, 8, config.hidden_size)
    for kwargs in (dict(cu_seqlens=CU), dict(token_mask=MASK), dict(context=alone(8, (0, 3, 8))), {}):
        inputs = describe_inputs(1, 8, **kwargs)
        assert torch.equal(attn(h, inputs=inputs), attn(h, **kwargs))
    with pytest.raises(ValueError, match="cu_seqlens: the token layout is already given by inputs"):
        attn(h, cu_seqlens=CU, inputs=describe_inputs(1, 8, cu_seqlens=CU))
    with pytest.raises(ValueError, match="hidden_states: inputs describe 1 x 4 tokens"):
        attn(h, inputs=describe_inputs(1, 4))
