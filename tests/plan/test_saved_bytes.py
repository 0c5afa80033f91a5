"""The planner's meters on meta: the results it reuses for repeated ops are what the ops make, and the meters
read the same with and without reusing them."""

import torch

import moe_plugin.ops.meta_loops as meta_loops
import moe_plugin.plan.saved_bytes as saved_bytes
from moe_plugin.compat.torch import makes_fresh_tensors
from moe_plugin.ops.dsa.attention import dense_causal_attention

aten = torch.ops.aten


def _meters(fn, segment: str):
    """What the planner's meters read of ``fn`` (its result summed and run backward for the peak): the saved
    bytes of ``segment``, the forward's working bytes, and the forward and backward's peak."""
    working, peak = [], saved_bytes._LiveBytes()
    saved = saved_bytes._run(fn, {}, segment, working)
    with peak:
        fn().sum().backward()
    return saved, working, peak.peak


def test_only_ops_that_make_new_tensors_are_reused():
    assert makes_fresh_tensors(aten.mm.default) and makes_fresh_tensors(aten.mul.Tensor)
    assert makes_fresh_tensors(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not makes_fresh_tensors(aten.add_.Tensor)  # writes its argument
    assert not makes_fresh_tensors(aten.transpose.int)  # a view
    assert not makes_fresh_tensors(aten.split_with_sizes.default)  # a list of views
    assert not makes_fresh_tensors(aten.nonzero.default)  # its shape is its values'


def test_a_reused_result_has_the_shape_stride_and_dtype_the_op_gives():
    saved_bytes._META_RESULTS.clear()
    x = torch.empty(6, 4, device="meta").t()  # a transposed layout: the result follows it
    y = torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    for args, op in [((x, y), aten.mul.Tensor), ((x, 2.0), aten.mul.Tensor), ((x,), aten.exp.default)]:
        first = saved_bytes._meta_results(op, args, {})
        again = saved_bytes._meta_results(op, args, {})
        want = op(*args)
        for got in (first, again):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert again.untyped_storage()._cdata != first.untyped_storage()._cdata  # a storage of its own
    for _ in range(2):  # an op of two results gives two again, each of its own shape and dtype
        values, where = saved_bytes._meta_results(aten.max.dim, (x, 1), {})
        assert (values.shape, values.dtype, where.shape, where.dtype) == ((4,), torch.float32, (4,), torch.int64)
    sums = saved_bytes._meta_results(aten.sum.dim_IntList, (x, [1], True), {})
    assert sums.shape == (4, 1) and saved_bytes._meta_results(aten.sum.dim_IntList, (x, [0], True), {}).shape == (1, 6)


def _attention_meters():
    q, k, v = (torch.empty(1, 300, 2, 8, device="meta", requires_grad=True) for _ in range(3))
    return _meters(lambda: dense_causal_attention(q, k, v, 0.5, block_size=64, key_chunk=64), "attn")


def test_the_meters_read_the_same_reusing_results(monkeypatch):
    saved_bytes._META_RESULTS.clear()
    reused = _attention_meters()
    assert saved_bytes._META_RESULTS  # the blocks' ops were met again
    monkeypatch.setattr(saved_bytes, "makes_fresh_tensors", lambda func: False)
    assert _attention_meters() == reused


def _dense_meters(T, offsets, block, key_chunk):
    q, k, v = (torch.empty(1, T, 2, 8, device="meta", requires_grad=True) for _ in range(3))
    cu = torch.tensor(offsets) if offsets else None
    return _meters(lambda: dense_causal_attention(q, k, v, 0.5, cu, block_size=block, key_chunk=key_chunk), "attn")


def test_on_meta_the_widest_blocks_hold_the_attention_loops_peak(monkeypatch):
    """On meta the blocked attention runs only the widest-spanned block of each kind; its meters read what all
    blocks give: one document, packed documents, a last block shorter than the rest, spans of one chunk and of
    several."""
    import moe_plugin.ops.dsa.attention as attention

    cases = [(300, None, 64, 96), (300, (0, 10, 150, 155, 300), 64, 64), (257, (0, 200, 257), 32, 500)]
    shortcut = [_dense_meters(*case) for case in cases]
    every_block = attention._blocks

    def off_meta(T, block, chunk, plan, b, meta):
        return every_block(T, block, chunk, plan, b, False)

    monkeypatch.setattr(attention, "_blocks", off_meta)
    assert [_dense_meters(*case) for case in cases] == shortcut


def _packed_meters(counts, group_size, in_features=64, out=96):
    from moe_plugin.ops.offsets import counts_tensor
    from moe_plugin.ops.quant.experts import packed_grouped_linear

    E = len(counts)
    x = torch.empty(sum(counts), in_features, device="meta", requires_grad=True)
    packed = torch.empty(E, out, in_features // 2, dtype=torch.uint8, device="meta")
    scale = torch.empty(E, out, in_features // 32, dtype=torch.uint8, device="meta")
    tokens = counts_tensor(counts, "meta")
    fn = lambda: packed_grouped_linear(x, tokens, packed, scale, "mxfp4", in_features, group_size)  # noqa: E731
    return _meters(fn, "experts")


def test_on_meta_the_largest_groups_hold_the_packed_experts_peak(monkeypatch):
    """On meta a packed expert layer dequantises only the group with the most rows of each size, and decodes
    one slice of each size; its meters read what every group and slice gives: groups of several sizes, an
    empty one, rows uneven among them."""
    import moe_plugin.ops.meta_loops as meta_loops
    import moe_plugin.ops.quant.experts as experts

    monkeypatch.setattr(experts, "MIN_DECODE_CHUNK", 64)  # several decode slices at this size
    cases = [([300, 0, 700, 100, 0, 0, 90, 20, 500, 400, 0], 4), ([0, 0, 2, 0, 600], 2), ([5] * 9, 3)]
    shortcut = [_packed_meters(*case) for case in cases]
    every_step = meta_loops.steps_to_run
    monkeypatch.setattr(experts, "steps_to_run", lambda steps, meta, kind, size: every_step(steps, False, kind, size))
    assert [_packed_meters(*case) for case in cases] == shortcut


def _latent_meters(T, S, runs, offsets, block, key_chunk):
    from moe_plugin.ops.dsa.latent_attention import causal_plan, latent_attention

    q = torch.empty(1, T, 2, 8, device="meta", requires_grad=True)
    latent = torch.empty(1, S, 6, device="meta", requires_grad=True)
    proj = torch.empty(2 * (8 + 5), 6, device="meta", requires_grad=True)

    def expand(x):  # MLA's up-projection, shrunk: per-head keys and values from the latent
        k, v = torch.nn.functional.linear(x, proj).view(1, x.shape[1], 2, 13).split([8, 5], -1)
        return k, v

    plan = causal_plan(S, runs, torch.tensor(offsets) if offsets else None, device="meta")
    fn = lambda: latent_attention(q, latent, expand, 0.5, plan, block, key_chunk)  # noqa: E731
    return _meters(fn, "attn")


def test_on_meta_the_widest_chunks_hold_the_latent_attention_loops_peak(monkeypatch):
    """On meta the latent attention expands only the widest chunk of each width and runs its widest block of each
    size; its meters read what every chunk and block gives: a slice at the row's end, packed documents, two runs
    of positions, a last chunk and block shorter than the rest."""
    import moe_plugin.ops.dsa.latent_attention as latent

    cases = [
        (100, 300, [(0, 100, 200)], None, 32, 64),
        (100, 300, [(0, 100, 200)], (0, 10, 150, 250, 300), 32, 96),
        (90, 400, [(0, 45, 50), (45, 90, 355)], (0, 300, 400), 16, 128),
    ]
    shortcut = [_latent_meters(*case) for case in cases]
    every_step = latent.steps_to_run
    monkeypatch.setattr(latent, "steps_to_run", lambda steps, meta, kind, size: every_step(steps, False, kind, size))
    assert [_latent_meters(*case) for case in cases] == shortcut


def _kda_meters(T, offsets, batch=1, context=None):
    from moe_plugin.ops.kda import chunk_kda
    from moe_plugin.ops.kda.context_parallel import chunk_kda_context

    H, K, V = 2, 8, 4
    q, k, g = (torch.empty(batch, T, H, K, device="meta", requires_grad=True) for _ in range(3))
    v = torch.empty(batch, T, H, V, device="meta", requires_grad=True)
    beta = torch.empty(batch, T, H, device="meta", requires_grad=True)
    if context is not None:
        fn = lambda: chunk_kda_context(q, k, v, g, beta, context, chunk_size=4)  # noqa: E731
    else:
        cu = torch.tensor(offsets) if offsets else None
        states = batch if cu is None else len(offsets) - 1
        h0 = torch.empty(states, H, K, V, device="meta", requires_grad=True)

        def fn():
            o, final = chunk_kda(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=4
            )
            return o.sum() + final.sum()

    return _meters(fn, "kda")


def test_on_meta_one_window_of_each_kind_holds_the_kda_loops_peak(monkeypatch):
    """On meta the KDA chunk path (ops/kda/chunk.py run_chunks) runs one window of each kind, forward and
    backward; its meters read what running every window gives: rows of one sequence with a shorter last
    window, packed sequences beginning and ending inside windows (one of no tokens), and the context path's
    last rank of a row whose document crosses every slice."""
    import moe_plugin.ops.kda.chunk as kda_chunk
    from moe_plugin.plan.context_parallel import meta_slice

    monkeypatch.setattr(kda_chunk, "WINDOW_CHUNKS", 2)
    cases = [
        dict(T=37, offsets=None, batch=2),
        dict(T=64, offsets=(0, 8, 8, 13, 40, 64)),
        dict(T=36, offsets=None, context=meta_slice(2, (0, 72))),
        dict(T=36, offsets=None, context=meta_slice(2, (0, 3, 50, 60, 72))),
    ]
    shortcut = [_kda_meters(**case) for case in cases]
    every_step = meta_loops.steps_to_run
    monkeypatch.setattr(kda_chunk, "steps_to_run", lambda steps, meta, kind, size: every_step(steps, False, kind, size))
    assert [_kda_meters(**case) for case in cases] == shortcut
