"""The planner's context parallelism (``moe-plugin plan --context-parallel``): a rank's token-wise bytes are
1/CP of the row's, the gated-MLA layers' gathered latent covers the whole row whatever CP is (its keys and values
expanded a chunk at a time, never held for the row), KDA's exchange does
not grow with T, a bad size is refused naming the flag or the field, and the search picks the smallest CP that
fits. Meta-device planning only, no launches."""

from __future__ import annotations

import math

import json

import pytest
import torch

from moe_plugin.plan import command
from moe_plugin.plan.activations import _state_shape, layer_saved_bytes
from moe_plugin.plan.context_parallel import context_candidates, describe_search, smallest_context
from moe_plugin.plan.routing import BalancedDispatch
from moe_plugin.plan.planner import plan_recipe
from moe_plugin.recipe.schema import recipe_from_dict

TINY = {
    "output_dir": "outputs/never",
    "model": {"preset": "tiny"},
    "lora": {"r": 8},
    "data": {"kind": "arithmetic", "num_documents": 200, "seq_len": 256, "eval_fraction": 0.0},
    "parallel": {"expert_parallel_size": 2},
    "schedule": {"micro_batch_size": 1, "precision": "bf16"},
}
T = 1024


@pytest.fixture(scope="module")
def cache():
    return {}


@pytest.fixture(scope="module")
def recipe():
    return recipe_from_dict(TINY)


def _plan(recipe, cache, **kw):
    args = dict(devices=8, seq_len=T, kernels="cpu", from_checkpoint=True, cache=cache, summaries=False)
    args.update(kw)
    return plan_recipe(recipe, **args)


def _mc():
    from moe_plugin.models import preset_config

    return preset_config("tiny").to_model_config()


@pytest.mark.parametrize("cp", [2, 4])
def test_token_wise_bytes_are_one_cp_th(recipe, cache, cp):
    mc = _mc()
    full = _plan(recipe, cache, checkpointing="full", context_parallel=cp)
    n = T // cp  # this rank's tokens of the row
    m = full.memory
    assert m.context["tokens_per_rank_micro_batch"] == n
    # every layer keeps its [n, D] input in bf16
    assert m.activations_by_segment["layer inputs"] == mc.num_layers * n * mc.hidden_size * 2
    # dispatch and combine buffers: n x top-k x capacity rows at latent width, bf16
    assert m.dispatch == 2 * n * mc.moe.top_k * 1.25 * mc.moe.expert_dim * 2
    assert full.tokens_per_step == 8 // cp * T  # the CP ranks of a group share their rows
    # ZeRO-3 shards over data x context = all 8 ranks: the weights' shares are those of CP 1
    one = _plan(recipe, cache, checkpointing="full", context_parallel=1)
    assert m.base == one.memory.base and m.adapters == one.memory.adapters and m.gathered == one.memory.gathered
    assert m.context["data_parallel"] == 8 // cp and m.context["zero3_shards"] == 8
    # without checkpointing, the token-wise segments are those of one rank planned at n tokens, and each is
    # the CP 1 row's over CP (but for the packing's cuts within 2 %, and the MoE's per-expert rounding)
    off = _plan(recipe, cache, context_parallel=cp).memory.activations_by_segment
    short = _plan(recipe, cache, seq_len=n, context_parallel=1).memory.activations_by_segment
    row = _plan(recipe, cache).memory.activations_by_segment
    for seg in ("kda", "mlp", "attn_res"):
        assert off[seg] == short[seg]
    for seg in ("kda", "mlp", "attn_res", "head"):
        assert off[seg] == pytest.approx(row[seg] / cp, rel=0.02), seg
    assert off["moe"] == pytest.approx(row["moe"] / cp, rel=0.05)  # each local expert's rows rounded up
    # the gated-MLA layers hold the whole row's latent, not one process's expanded keys and values: they shrink
    # by more than CP
    assert off["mla"] < row["mla"] / cp


def test_the_mla_layers_gathered_latent_covers_the_whole_row():
    """One gated-MLA layer as the row's last rank: its bytes are q x (its T/CP queries) + k x (the row's T keys)
    + a constant, where k is exactly the gathered latent and index key of a key (bf16): none of the keys and
    values expanded from it (a chunk at a time, freed before the backward)."""
    mc = _mc()
    index = mc.layer_types.index("mla")
    routing = BalancedDispatch(mc.moe.num_experts, 1.0)

    def saved(row, cp):
        shape = (1, row // cp, mc.hidden_size)
        run = dict(context=(cp, (0, row)), routing=routing)
        return layer_saved_bytes(mc, index, None, shape, torch.bfloat16, len(_state_shape(index, mc)), **run)["mla"]

    per_query = (saved(T, 2) - saved(T, 4)) / (T // 2 - T // 4)
    per_key = (saved(2 * T, 4) - saved(T, 2)) / T  # the same T / 2 queries, T more keys
    # (the queries are re-laid out in CP runs of T / CP^2: a few bytes of each run's bookkeeping beside)
    assert saved(T, 8) == pytest.approx(saved(T, 4) - per_query * T // 8, rel=1e-3)
    m = mc.mla
    latent = (m.kv_lora_rank + m.qk_rope_head_dim + m.index_head_dim) * 2
    expanded = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    assert per_key == pytest.approx(latent, rel=1e-3) and per_key < latent + expanded / 100


def test_the_kda_exchange_does_not_grow_with_the_row_or_the_group(recipe, cache):
    """KDA's prefix scan: a pair (fp32 transition [K, K] and state [K, V] per head) sent in each of log2(CP)
    rounds, then the state, and the convolutions' last W - 1 inputs; held for the backward, the rank's own pair,
    whatever the row's length and the group's size."""
    k = _mc().kda
    pair = k.num_heads * k.head_dim * 2 * k.head_dim * 4
    conv = (k.conv_size - 1) * 3 * k.num_heads * k.head_dim * 2  # q, k, v convolutions' last W - 1 inputs, bf16
    kda_layers = sum(t == "kda" for t in _mc().layer_types)
    for seq_len, cp, rounds in ((512, 2, 1), (1024, 2, 1), (1024, 4, 2)):
        plan = _plan(recipe, cache, seq_len=seq_len, context_parallel=cp)
        assert plan.context_exchange["KDA exchange sent per layer"] == rounds * pair + pair // 2 + conv
        assert plan.context_exchange["KDA exchange held per layer (own pair)"] == pair
        assert plan.memory.activations_by_segment["context exchange"] == kda_layers * pair
    assert _plan(recipe, cache, context_parallel=1).context_exchange == {}


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(context_parallel=3), ["--context-parallel: 3 does not divide the world size 8", "--devices"]),
        (dict(context_parallel=16), ["--context-parallel: 16 does not divide the world size 8"]),
        (dict(context_parallel=4, seq_len=1026), ["--context-parallel: 4 does not divide the sequence length 1026"]),
        (dict(context_parallel=0), ["--context-parallel: must be a positive whole number"]),
        (dict(context_parallel="auto"), ["--context-parallel: auto", "--device-memory"]),
    ],
)
def test_a_bad_size_names_the_flag(recipe, cache, kw, words):
    with pytest.raises(ValueError) as err:
        _plan(recipe, cache, **kw)
    for w in words:
        assert w in str(err.value)


def test_the_recipes_size_is_named_as_its_field(cache):
    recipe = recipe_from_dict({**TINY, "parallel": {"expert_parallel_size": 2, "context_parallel_size": 4}})
    with pytest.raises(ValueError, match=r"^parallel.context_parallel_size: 4 does not divide the world size 6"):
        _plan(recipe, cache, devices=6)
    assert _plan(recipe, cache).layout.context == 4  # taken from the recipe


def test_the_command_line_refuses_a_bad_flag_in_one_line(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    assert command.main(["--recipe", str(path), "--devices", "8", "--context-parallel", "two"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--context-parallel: must be a positive whole number of ranks or 'auto'" in err[0]


def test_the_search_picks_the_smallest_cp_that_fits(recipe, cache):
    mode = "selective"
    peaks = {cp: _plan(recipe, cache, context_parallel=cp, checkpointing=mode).memory.peak for cp in (1, 2, 4, 8)}
    assert peaks[1] > peaks[2] > peaks[4]
    memory = (peaks[2] + peaks[4]) / 2  # CP 4 fits, CP 2 does not
    plan = _plan(recipe, cache, context_parallel="auto", checkpointing=mode, device_memory=memory)
    found = plan.context_search
    assert found["cp"] == 4 and plan.layout.context == 4 and not found["more_devices"]
    # bisected: the answer and the CP just below it are among the planned ones, each planned as a fixed CP plans it
    assert found["tried"][4] == (peaks[4], mode) and found["tried"][2] == (peaks[2], mode)
    assert found["tried"][1] == (peaks[1], mode)
    assert plan.memory.peak == peaks[4] <= memory < peaks[2] and plan.layout.checkpointing == mode


def test_full_that_does_not_fit_falls_back_to_keeping_only_the_routing(recipe, cache):
    """Asked for full checkpointing, the search also tries full_routing (the MoE keeps only its routing), names
    it where it is what fits, and plans the layout with it."""
    modes = ("full", "full_routing")
    peak = {mode: _plan(recipe, cache, context_parallel=2, checkpointing=mode).memory.peak for mode in modes}
    assert peak["full_routing"] < peak["full"]
    memory = (peak["full_routing"] + peak["full"]) / 2
    ones = [_plan(recipe, cache, context_parallel=1, checkpointing=m).memory.peak for m in modes]
    assert min(ones) > memory  # CP 1 fits in neither mode
    plan = _plan(recipe, cache, context_parallel="auto", checkpointing="full", device_memory=memory)
    found = plan.context_search
    assert (found["cp"], found["mode"]) == (2, "full_routing")
    assert found["tried"][2] == (peak["full_routing"], "full_routing")
    assert plan.layout.checkpointing == "full_routing" and plan.memory.peak == peak["full_routing"]
    text = describe_search(found, found["seq_len"], plan.layout.devices, found["modes"], memory)
    assert 'set schedule.activation_checkpointing "full_routing" and parallel.context_parallel_size 2' in text


def test_the_search_asks_for_more_devices_when_none_dividing_them_fits():
    peak = lambda cp, devices, mode: 100.0 / cp  # noqa: E731
    found = smallest_context(peak, 4, 1 << 20, 8, 10.0, 1 << 16, ["full"])
    assert found["cp"] == 16 and found["devices"] == 16 and found["more_devices"]  # 100/8 > 10 >= 100/16
    assert {8, 16} <= set(found["tried"]) and found["tried"][8][0] > 10.0
    none = smallest_context(peak, 4, 8, 1, 1.0, 1 << 16, ["full"])
    assert none["cp"] is None and none["floor"] == (8, 8) and none["tried"][8] == (12.5, "full")


@pytest.mark.parametrize("devices,ep", [(128, 64), (6, 2), (1, 1)])
def test_the_bisected_search_answers_as_trying_every_cp_in_order(devices, ep):
    """With a peak that does not grow with CP (what the plan's is), the bisection finds what trying every
    candidate in order finds, for every memory between the peaks, planning about log2 of the candidates."""
    seq_len, largest = 1 << 20, 1 << 16
    candidates = context_candidates(devices, seq_len, ep, largest)
    peak = lambda cp, on, mode: 1e3 / cp + 5e2 / on + (0.5 if mode == "full" else 0.0)  # noqa: E731
    peaks = sorted({peak(cp, on, m) for cp, on in candidates for m in ("full", "full_routing")}, reverse=True)
    for memory in [p + d for p in peaks for d in (-1e-9, 0.0)] + [peaks[-1] / 2, peaks[0] * 2]:
        calls = []
        counted = lambda cp, on, mode, calls=calls: calls.append(cp) or peak(cp, on, mode)  # noqa: E731
        found = smallest_context(counted, devices, seq_len, ep, memory, largest, ["full", "full_routing"])
        linear = next(
            ((cp, on, m) for cp, on in candidates for m in ("full", "full_routing") if peak(cp, on, m) <= memory),
            None,
        )
        if linear is None:
            assert found["cp"] is None and found["floor"] == candidates[-1]
        else:
            assert (found["cp"], found["devices"], found["mode"]) == linear
            assert found["more_devices"] == (linear[1] != devices)
        assert len(set(calls)) <= math.ceil(math.log2(len(candidates))) + 2


@pytest.mark.parametrize("chunks,share", [(1, 1.0), (2, 1.0), (4, 0.5)])
def test_dispatch_buffers_per_overlapped_chunk(recipe, cache, chunks, share):
    """parallel.moe_overlap_chunks N: at most one chunk's dispatch and one chunk's return are in flight, each a
    send and a receive of 1 / N of the rows, so the buffers are min(1, 2 / N) of one exchange's."""
    chunked = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"moe_overlap_chunks": chunks})})
    mc = _mc()
    m = _plan(chunked, {}, checkpointing="full", context_parallel=2).memory
    n = T // 2
    assert m.dispatch == pytest.approx(2 * n * mc.moe.top_k * 1.25 * mc.moe.expert_dim * 2 * share)
