"""The decoder layer's one composition (moe_plugin/layers/composition.py) against the layer written out: plain
residual adds and Attention-Residual mixes, dense and MoE, in every recompute mode; the MoE runs once outside
the regions, the recomputed sublayers again in the backward."""

from __future__ import annotations

import pytest
import torch

from moe_plugin.layers.attn_res import attn_res_mix, attn_res_point, layer_stream
from moe_plugin.layers.composition import LayerParts, run_layer
from moe_plugin.layers.recompute import MODES

D = 8


class Counted:
    """fn with a call count (a recomputed sublayer runs again in the backward)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _weights():
    g = torch.Generator().manual_seed(0)
    return [(0.3 * torch.randn(D, D, generator=g)).requires_grad_() for _ in range(3)]


def _parts(a, b, c, moe: bool, attn_res: bool, layer_idx: int = 1, block_size: int = 2, points=()):
    attention = Counted(lambda x: (torch.tanh(x @ a), "aux"))
    mlp_norm = Counted(_norm)
    dense = Counted(lambda x: torch.relu(x @ b))
    routed = Counted(lambda h: (h @ c, torch.tensor([3, 1])))
    parts = LayerParts(
        stream=lambda state, after: layer_stream(
            state, after, attn_res=attn_res, layer_idx=layer_idx, block_size=block_size
        ),
        attention=attention,
        mlp_norm=mlp_norm,
        mlp=None if moe else dense,
        moe=routed if moe else None,
        attention_point=points[:2] if points else (),
        mlp_point=points[2:] if points else (),
        ends_block=attn_res and layer_idx % 2 == 1,
    )
    return parts, {"attention": attention, "mlp_norm": mlp_norm, "dense": dense, "moe": routed}


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_plain_layer_is_the_two_residual_adds(moe, mode):
    a, b, c = _weights()
    h = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    parts, calls = _parts(a, b, c, moe, attn_res=False)
    (after,), load, aux = run_layer((h,), parts, mode)
    h1 = h + torch.tanh(h @ a)
    want = h1 + (_norm(h1) @ c if moe else torch.relu(_norm(h1) @ b))
    assert torch.equal(after, want) and aux == "aux"
    assert torch.equal(load, torch.tensor([3, 1])) if moe else load is None
    after.sum().backward()
    again = mode != "off"  # both recomputing modes redo the attention and the norm; the MoE never reruns
    assert calls["attention"].calls == calls["mlp_norm"].calls == 1 + again
    assert calls["moe" if moe else "dense"].calls == (1 if moe else 1 + again)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_attn_res_layer_mixes_the_block_values_and_closes_the_block(moe, mode):
    a, b, c = _weights()
    g = torch.Generator().manual_seed(2)
    embeddings, partial = torch.randn(2, 5, D, generator=g), torch.randn(2, 5, D, generator=g)
    (p1, n1), (p2, n2) = attn_res_point(D, 1e-6), attn_res_point(D, 1e-6)
    with torch.no_grad():
        for p in (p1, p2, n1, n2):
            p.weight.copy_(torch.randn(p.weight.shape, generator=g))
    parts, _ = _parts(a, b, c, moe, attn_res=True, points=(p1, n1, p2, n2))
    # layer 1 of blocks of 2: it reads (embedding, partial sum of layer 0) and closes the block
    after, _, _ = run_layer((embeddings, partial), parts, mode)

    def mix(candidates, proj, norm):
        return attn_res_mix(candidates, proj.weight, norm.weight, 1e-6)

    s1 = partial + torch.tanh(mix([embeddings, partial], p1, n1) @ a)
    x = _norm(mix([embeddings, s1], p2, n2))
    want = s1 + (x @ c if moe else torch.relu(x @ b))
    assert len(after) == 2 and torch.equal(after[0], embeddings)  # the closed block joins the embedding
    torch.testing.assert_close(after[1], want)  # the mix calls the point's modules; written out it is a matmul


def test_a_layer_has_one_mlp_kind():
    a, b, c = _weights()
    parts, _ = _parts(a, b, c, moe=True, attn_res=False)
    with pytest.raises(ValueError, match="exactly one of mlp"):
        run_layer((torch.zeros(1, 1, D),), parts._replace(mlp=lambda x: x))
    with pytest.raises(ValueError, match="exactly one of mlp"):
        run_layer((torch.zeros(1, 1, D),), parts._replace(moe=None))
