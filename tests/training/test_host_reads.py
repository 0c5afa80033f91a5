"""The host-read counter (moe_plugin/training/metrics/host_reads.py): it counts a planted read in the layer
kind it happens in, counts nothing for pure tensor code, and measures the tiny model's layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_plugin
from moe_plugin.layers.norm import RMSNorm
from moe_plugin.training.metrics.host_reads import KINDS, count_host_reads


class _ReadingNorm(RMSNorm):
    """An RMSNorm that reads its input's mean on the host (the planted read)."""

    def forward(self, x):
        self.seen = x.mean().item()
        return super().forward(x)


class _Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.lin(x))


def test_planted_item_counts_for_its_kind():
    net = _Net(_ReadingNorm(8))
    x = torch.randn(2, 8)
    with count_host_reads(net) as counts:
        net(x).sum().backward()
        bool(x.sum() > 0)  # outside any module: the trainer's
    per_kind = counts.per_kind()
    assert set(per_kind) == set(KINDS)
    assert per_kind["norm"] == 1 and per_kind["trainer"] == 1 and counts.total() == 2
    assert counts.detail() == {("norm", "item"): 1, ("trainer", "__bool__"): 1}


def test_data_dependent_shapes_count():
    x = torch.tensor([0, 2, 1, 0])
    with count_host_reads(nn.Identity()) as counts:
        x.nonzero()
        x[x > 0]
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, 2)  # an int repeats: the shape is known, no read
        x[torch.tensor([0, 1])]  # integer indexing: no read
    assert counts.detail() == {
        ("trainer", "bool_index"): 1,
        ("trainer", "nonzero"): 1,
        ("trainer", "repeat_interleave"): 1,
    }


def test_pure_tensor_code_counts_nothing():
    net = _Net(RMSNorm(8))
    with count_host_reads(net) as counts:
        net(torch.randn(3, 8)).pow(2).mean().backward()
    assert counts.total() == 0


def test_hooks_are_removed():
    net = _Net(_ReadingNorm(8))
    with count_host_reads(net):
        pass
    assert not net._forward_pre_hooks and not net.norm._forward_hooks


def test_tiny_model_reads_per_kind():
    """Forward+backward of the tiny preset on CPU. The goal (issue 24) is 0 in KDA, MLA, DSA, norms, AttnRes;
    these are the measured counts, each explained (sites from ``counts.by_site``)."""
    torch.manual_seed(0)
    model = moe_plugin.MoEPluginForCausalLM(moe_plugin.preset_config("tiny"))
    ids = torch.randint(0, 256, (1, 64))
    with count_host_reads(model) as counts:
        model(input_ids=ids, labels=ids).loss.backward()
    per_kind = counts.per_kind()
    # none: the norms, AttnRes, the DSA indexer, the dense MLP, and the backward / trainer side
    assert per_kind["norm"] == per_kind["attn_res"] == per_kind["dsa"] == per_kind["mlp"] == 0
    assert per_kind["trainer"] == 0
    # KDA: none. The intra-chunk scores take the form the gate's bound fixes (ops/kda/intra.py), not one read
    # off the gates, and the bound's check reads nothing unless MOE_PLUGIN_DEBUG_CHECKS=1
    assert per_kind["kda"] == 0
    # MLA: none. sparse_attention takes its block spans from the visible ranges indexer_topk's result carries
    # (ops/dsa/masks.py remember_visible), the top-k tie rule is one top-k, no cu_seqlens here, and the index
    # range and repeated-key checks read nothing unless MOE_PLUGIN_DEBUG_CHECKS=1
    assert per_kind["mla"] == 0
    # MoE: none without expert parallelism. permute counts its rows into E slots (no bincount, which sizes its
    # output by a read of the largest id), and the id range and tokens_per_expert checks read nothing unless
    # MOE_PLUGIN_DEBUG_CHECKS=1
    assert per_kind["moe"] == 0
    # other: check_ids on the token ids and labels (models/inputs.py): aminmax then 2 ints, 3 calls
    assert per_kind["other"] == 6


def test_tiny_model_packed_rows_read_cu_seqlens_once():
    """Packed documents: the boundaries are read once in the whole step, by the first layer that needs them
    (ops/offsets.py host_offsets keeps the copy on the tensor; the indexer's result then carries them to sparse
    attention); MLA and DSA read nothing."""
    torch.manual_seed(0)
    model = moe_plugin.MoEPluginForCausalLM(moe_plugin.preset_config("tiny"))
    ids = torch.randint(0, 256, (1, 64))
    with count_host_reads(model) as counts:
        model(input_ids=ids, labels=ids, cu_seqlens=torch.tensor([0, 20, 64])).loss.backward()
    assert counts.per_kind()["dsa"] == counts.per_kind()["mla"] == 0
    assert sum(n for key, n in counts.detail().items() if key[1] == "tolist") == 1


def test_permute_id_range_checked_only_in_debug_mode(monkeypatch):
    from moe_plugin.ops.moe.permute import permute

    x, bad = torch.randn(4, 8), torch.full((4, 2), 3)
    monkeypatch.delenv("MOE_PLUGIN_DEBUG_CHECKS", raising=False)
    with count_host_reads(nn.Identity()) as counts:
        permute(x, torch.zeros(4, 2, dtype=torch.long), 3)
    assert counts.detail() == {}  # no aminmax read, no bincount
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match="^indices: expected expert ids in"):
        permute(x, bad, 3)
