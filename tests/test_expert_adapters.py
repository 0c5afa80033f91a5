"""moe_plugin.expert_adapters: every fast function against its plain reference on random shapes, split and stack
and slice and stitch as inverses, and the layout against what peft's ParamWrapper itself computes."""

import pytest
import torch

from moe_plugin.expert_adapters import (
    adapter_factor,
    slice_experts,
    slice_experts_reference,
    split_experts,
    split_experts_reference,
    split_factors,
    stack_experts,
    stack_experts_reference,
    stitch_experts,
    stitch_experts_reference,
)

# (E, r, in, out, EP): several expert counts, ranks, sizes and expert-parallel sizes (EP divides E)
SHAPES = [(1, 1, 3, 2, 1), (4, 2, 5, 3, 2), (6, 3, 4, 7, 3), (8, 1, 2, 6, 4), (8, 4, 3, 5, 8), (5, 3, 4, 7, 5)]


def _stacked(experts, r, inp, out, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r * experts, inp, generator=g), torch.randn(out, r * experts, generator=g)


@pytest.mark.parametrize("experts,r,inp,out,ep", SHAPES)
def test_split_and_stack_match_their_references_and_invert(experts, r, inp, out, ep):
    a, b = _stacked(experts, r, inp, out)
    fast, ref = split_experts(a, b, experts), split_experts_reference(a, b, experts)
    assert len(fast) == experts
    for (fa, fb), (ra, rb) in zip(fast, ref):
        assert fa.shape == (r, inp) and fb.shape == (out, r)
        assert torch.equal(fa, ra) and torch.equal(fb, rb)
    fa3, fb3 = split_factors(a, b, experts)
    assert fa3.shape == (experts, r, inp) and fb3.shape == (experts, out, r)
    assert all(torch.equal(fa3[e], fast[e][0]) and torch.equal(fb3[e], fast[e][1]) for e in range(experts))
    for stacked in (stack_experts(fast), stack_experts_reference(fast)):
        assert torch.equal(stacked[0], a) and torch.equal(stacked[1], b)  # split then stack is the identity
    per_expert = [(torch.randn(r, inp), torch.randn(out, r)) for _ in range(experts)]
    again = split_experts(*stack_experts(per_expert), experts)  # and stack then split
    assert all(torch.equal(x, y) for pair, pair2 in zip(per_expert, again) for x, y in zip(pair, pair2))


@pytest.mark.parametrize("experts,r,inp,out,ep", SHAPES)
def test_slices_match_their_reference_and_stitch_back_to_the_whole(experts, r, inp, out, ep):
    a, b = _stacked(experts, r, inp, out, seed=1)
    local = experts // ep
    for factor, whole in (("A", a), ("B", b)):
        parts = []
        for k in range(ep):
            first, last = k * local, (k + 1) * local
            part = slice_experts(whole, factor, first, last, experts)
            assert torch.equal(part, slice_experts_reference(whole, factor, first, last, experts))
            assert part.shape == ((r * local, inp) if factor == "A" else (out, r * local))
            parts.append(part)
        assert torch.equal(stitch_experts(parts, factor, r), whole)
        assert torch.equal(stitch_experts_reference(parts, factor, r), whole)
    # a rank's slice is that rank's experts in the same layout over E_local experts
    for k in range(ep):
        first, last = k * local, (k + 1) * local
        got = split_experts(
            slice_experts(a, "A", first, last, experts), slice_experts(b, "B", first, last, experts), local
        )
        want = split_experts(a, b, experts)[first:last]
        assert all(torch.equal(x, y) for p, q in zip(got, want) for x, y in zip(p, q))


def test_stitch_of_unequal_parts_matches_the_reference():
    r, out = 2, 3
    parts = [torch.randn(out, r * n) for n in (1, 3, 2)]
    assert torch.equal(stitch_experts(parts, "B", r), stitch_experts_reference(parts, "B", r))
    whole = stitch_experts(parts, "B", r)
    assert torch.equal(slice_experts(whole, "B", 1, 4, 6), parts[1])


def test_bad_arguments_name_the_field():
    a, b = _stacked(4, 2, 3, 5)
    with pytest.raises(ValueError, match="lora: a stacked expert adapter over 3 experts"):
        split_experts(a, b, 3)
    with pytest.raises(ValueError, match="factor: must be 'A'"):
        slice_experts(a, "C", 0, 1, 4)
    with pytest.raises(ValueError, match=r"value: experts \[2, 6\)"):
        slice_experts(a, "A", 2, 6, 4)


def test_adapter_factor_names_only_expert_adapters():
    assert adapter_factor("model.layers.1.block_sparse_moe.experts.lora_A.default.weight") == "A"
    assert adapter_factor("decoder.layers.0.mlp.experts.base_layer.base_layer.lora_B.default.weight") == "B"
    assert adapter_factor("model.layers.1.self_attn.q_proj.lora_A.default.weight") is None
    assert adapter_factor("model.layers.1.block_sparse_moe.experts.w1") is None


@pytest.mark.parametrize("experts,r", [(4, 2), (6, 3)])
def test_the_layout_is_peft_param_wrappers(experts, r):
    """Each expert's ``B_e @ A_e`` from ``split_experts`` is peft's own delta of that expert, and what merging
    the adapter adds to the expert's weight."""
    from moe_plugin.layers.stacked_experts import StackedExperts
    from moe_plugin.lora import add_lora, lora_config

    torch.manual_seed(0)
    holder = torch.nn.ModuleDict({"experts": StackedExperts(experts, 5, 7)})
    add_lora(holder, lora_config(r, 2 * r, [], ["experts.w1", "experts.w2"]))
    with torch.no_grad():
        for n, p in holder.named_parameters():
            if "lora_B" in n:
                p.normal_()
    wrappers = [m for m in holder.modules() if hasattr(m, "get_delta_weight")]
    assert len(wrappers) == 2
    for module in wrappers:
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        scaling = module.scaling["default"]
        delta = module.get_delta_weight("default")  # [E, out, in], peft's
        assert delta.shape[0] == experts
        for e, (a_e, b_e) in enumerate(split_experts(a.detach(), b.detach(), experts)):
            torch.testing.assert_close(scaling * b_e @ a_e, delta[e], rtol=1e-5, atol=1e-5)
        base = getattr(module.get_base_layer(), module.parameter_name)
        before = base.detach().clone()
        module.merge()
        for e, (a_e, b_e) in enumerate(split_experts(a.detach(), b.detach(), experts)):
            torch.testing.assert_close(base.detach()[e], before[e] + scaling * b_e @ a_e, rtol=1e-5, atol=1e-5)
        module.unmerge()


def test_init_draws_each_expert_as_the_whole_stack_does():
    """``init_expert_adapters`` writes expert j's rows through ``slice_experts``: a local stack over experts 2..5
    draws the rows the whole stack draws for them."""
    from moe_plugin.layers.stacked_experts import StackedExperts
    from moe_plugin.lora import add_lora, init_expert_adapters, lora_config

    def drawn(num, first):
        holder = torch.nn.ModuleDict({"experts": StackedExperts(num, 5, 7, first_expert=first)})
        add_lora(holder, lora_config(3, 6, [], ["experts.w1"]))
        assert init_expert_adapters(holder, seed=11) == num
        return next(p for n, p in holder.named_parameters() if "lora_A" in n).detach()

    assert torch.equal(drawn(4, 2), slice_experts(drawn(8, 0), "A", 2, 6, 8))
