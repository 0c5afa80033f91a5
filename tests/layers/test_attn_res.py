"""Attention Residuals against a plain per-position reference, and the block bookkeeping of the stream."""

import torch

from moe_plugin.layers.attn_res import (
    AttnResProjection,
    AttnResStream,
    PlainStream,
    attn_res_mix,
    attn_res_point,
    make_stream,
)


def _reference_mix(cands, proj, norm_w, eps):
    B, T, D = cands[0].shape
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            logits = []
            for c in cands:
                v = c[b, t].double()
                normed = v / torch.sqrt((v * v).mean() + eps) * norm_w.double()
                logits.append(float((normed * proj.double().reshape(-1)).sum()))
            m = max(logits)
            w = [torch.exp(torch.tensor(x - m, dtype=torch.float64)) for x in logits]
            z = sum(w)
            for wc, c in zip(w, cands):
                out[b, t] += wc / z * c[b, t].double()
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_mix_matches_per_position_reference():
    torch.manual_seed(0)
    cands = [torch.randn(2, 5, 16) * (i + 1) for i in range(4)]
    proj, norm_w = torch.randn(1, 16), torch.rand(16) + 0.5
    assert _rel(attn_res_mix(cands, proj, norm_w, 1e-5), _reference_mix(cands, proj, norm_w, 1e-5)) < 1e-6


def test_zero_projection_is_a_plain_average():
    cands = [torch.randn(1, 3, 8) for _ in range(3)]
    out = attn_res_mix(cands, torch.zeros(1, 8), torch.ones(8), 1e-5)
    assert _rel(out, sum(cands) / 3) < 1e-6


def test_stream_blocks_follow_the_block_size():
    """Two sublayers per layer, blocks of 2 layers: candidates are the embedding, completed block sums, partial."""
    torch.manual_seed(1)
    emb = torch.randn(1, 4, 8)
    outs = [torch.randn(1, 4, 8) for _ in range(6)]  # 3 layers x (attn, mlp)
    proj, norm_w = torch.randn(1, 8), torch.ones(8)
    stream = AttnResStream(emb)
    reads = []
    for layer in range(3):
        for sub in range(2):
            reads.append(attn_res_mix(stream.candidates(), proj, norm_w, 1e-5))
            stream.add(outs[2 * layer + sub])
        if (layer + 1) % 2 == 0:
            stream.end_block()
    # by hand: block 1 = sum of layers 0-1 outputs; layer 2 sees [emb, block1] then [emb, block1, out4]
    block1 = outs[0] + outs[1] + outs[2] + outs[3]
    assert _rel(reads[0], emb) < 1e-6
    assert _rel(reads[1], _reference_mix([emb, outs[0]], proj, torch.ones(8), 1e-5)) < 1e-6
    assert _rel(reads[3], _reference_mix([emb, outs[0] + outs[1] + outs[2]], proj, torch.ones(8), 1e-5)) < 1e-6
    assert _rel(reads[4], _reference_mix([emb, block1], proj, torch.ones(8), 1e-5)) < 1e-6
    assert _rel(reads[5], _reference_mix([emb, block1, outs[4]], proj, torch.ones(8), 1e-5)) < 1e-6
    final = [emb, block1, outs[4] + outs[5]]
    assert len(stream.candidates()) == 3 and _rel(stream.candidates()[2], final[2]) < 1e-6


def test_plain_stream_is_the_usual_residual():
    emb, a, b = torch.randn(3, 1, 2, 4).unbind(0)
    s = PlainStream(emb)
    s.add(a)
    s.add(b)
    assert torch.equal(s.read(), emb + a + b)


def test_projection_starts_at_zero_and_resets_to_zero():
    proj, norm = attn_res_point(8, 1e-5)
    assert isinstance(proj, AttnResProjection) and proj.weight.shape == (1, 8)
    assert torch.equal(proj.weight, torch.zeros(1, 8)) and torch.equal(norm.weight, torch.ones(8))
    with torch.no_grad():
        proj.weight.fill_(1.0)
    proj.reset_parameters()
    assert torch.equal(proj.weight, torch.zeros(1, 8))


def test_make_stream_picks_the_form():
    emb = torch.randn(1, 2, 4)
    assert isinstance(make_stream(emb, True), AttnResStream) and isinstance(make_stream(emb, False), PlainStream)
