"""KDA ops: chunked form against the token-by-token form and transformers' independent implementation."""

import importlib
import inspect
import math

import pytest
import torch

import moe_plugin.ops.backend as backend
import moe_plugin.ops.kda.chunk as kda_chunk
from moe_plugin.ops.kda import chunk_kda, kda_gate_k3, kda_gate_kimi_linear, l2norm, naive_recurrent_kda


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_inputs(B=2, T=100, H=3, K=16, V=8, dtype=torch.float64, g=None, seed=0, states=None):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k = l2norm(rnd(B, T, H, K)), l2norm(rnd(B, T, H, K))
    v = rnd(B, T, H, V)
    if g is None:
        g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    elif callable(g):
        g = g((B, T, H, K), gen).to(dtype)
    else:
        g = torch.full((B, T, H, K), float(g), dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = rnd(states or B, H, K, V)
    return q, k, v, g, beta, h0


def mixed_decay(strong):
    """Half the channels at ``strong``, the rest mild; whole tokens strong now and then."""

    def build(shape, gen):
        mild = -0.1 * torch.rand(shape, generator=gen, dtype=torch.float64)
        channel = torch.rand(shape[-1], generator=gen) < 0.5
        token = torch.rand(shape[:-1], generator=gen).unsqueeze(-1) < 0.2
        return torch.where(channel | token, torch.full(shape, float(strong), dtype=torch.float64), mild)

    return build


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,chunk", [(100, 64), (64, 64), (37, 16), (130, 32), (50, 10), (5, 64)])
@pytest.mark.parametrize("g", [None, -5.0, "mixed"], ids=["mild", "g=-5", "mixed"])
def test_chunk_equals_recurrent(dtype, T, chunk, g):
    q, k, v, g, beta, h0 = make_inputs(T=T, dtype=dtype, g=mixed_decay(-5.0) if g == "mixed" else g)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk)
    assert o.dtype == dtype and o.shape == v.shape and s.shape == h0.shape
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strong", [-30.0, -400.0])
def test_chunk_equals_recurrent_extreme_decay(dtype, strong):
    """Decay far beyond K3's bound (the Kimi-Linear gate is unbounded): every split of the scores is used."""
    q, k, v, g, beta, h0 = make_inputs(T=150, dtype=dtype, g=mixed_decay(strong))
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all()
    assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype]


def test_defaults_scale_and_no_state():
    q, k, v, g, beta, _ = make_inputs(T=40)
    o, s = chunk_kda(q, k, v, g, beta, scale=0.3, chunk_size=16)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    assert s is None and rel(o, o_ref) <= 1e-10
    o_default, _ = chunk_kda(q, k, v, g, beta)
    o_scaled, _ = naive_recurrent_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)
    assert rel(o_default, o_scaled) <= 1e-10


def test_low_precision_inputs_give_outputs_in_vs_dtype():
    """bf16 q, k, v, beta with the fp32 gate the KDA layer computes (its A_log and dt_bias are kept fp32): both
    forms compute in fp32 and hand o back in v's dtype (the layer's o_proj is bf16), the state in fp32, and the
    decoding step's output equals the chunked form's within bf16 rounding."""
    q, k, v, g, beta, h0 = make_inputs(B=2, T=9, dtype=torch.float32)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == o_ref.dtype == torch.bfloat16 and s.dtype == s_ref.dtype == torch.float32
    assert rel(o.float(), o_ref.float()) <= 1e-2 and rel(s, s_ref) <= 1e-4


def test_recurrent_matches_a_plain_loop():
    """The reference itself against the recurrence written out per head with matrices."""
    q, k, v, g, beta, h0 = make_inputs(B=1, T=7, H=2, K=4, V=3)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    for h in range(2):
        S = h0[0, h].clone()
        for t in range(7):
            S = torch.diag(g[0, t, h].exp()) @ S
            kt = k[0, t, h][:, None]
            S = S + beta[0, t, h] * kt @ (v[0, t, h][None] - kt.T @ S)
            assert rel(o[0, t, h], S.T @ (0.7 * q[0, t, h])) <= 1e-12
        assert rel(s[0, h], S) <= 1e-12


@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda])
def test_packed_sequences_equal_each_alone(fn):
    lengths = [10, 0, 65, 3, 22]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    q, k, v, g, beta, h0 = make_inputs(B=1, T=sum(lengths), g=mixed_decay(-5.0), states=len(lengths))
    kwargs = {"chunk_size": 16} if fn is chunk_kda else {}
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kwargs)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_i, s_i = naive_recurrent_kda(*part, initial_state=h0[i : i + 1], output_final_state=True)
        if b > a:
            assert rel(o[:, a:b], o_i) <= 1e-10
        assert rel(s[i : i + 1], s_i) <= 1e-10


def test_packed_without_initial_state():
    cu = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
    q, k, v, g, beta, _ = make_inputs(B=1, T=80)
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert rel(o, o_ref) <= 1e-10 and rel(s, s_ref) <= 1e-10


@pytest.mark.parametrize("g", [None, mixed_decay(-1000.0)], ids=["mild", "extreme"])
def test_chunk_gradcheck(g):
    q, k, v, g, beta, h0 = make_inputs(B=1, T=11, H=1, K=4, V=3, g=g)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("g", [None, -5.0, mixed_decay(-5.0), mixed_decay(-400.0)])
def test_chunk_gradients_equal_recurrent(g):
    q, k, v, g, beta, h0 = make_inputs(T=70, g=g)
    grads = []
    for fn, extra in ((naive_recurrent_kda, {}), (chunk_kda, {"chunk_size": 32})):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True, **extra)
        weight = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        ((o * weight).sum() + s.pow(2).sum()).backward()
        grads.append([x.grad for x in inputs])
    for name, a, b in zip("q k v g beta h0".split(), grads[1], grads[0]):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-9, name


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("layout", ["packed", "packed_no_state", "batch"])
@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "as_traced"])
def test_windows_of_chunks_equal_recurrent(monkeypatch, window, layout, compiling):
    """The chunk path held window by window (``chunk.run_chunks``, backward recomputing each window), and as
    dynamo traces it (one window under autograd): outputs, final states and every gradient equal the recurrent
    form's, with sequences spanning windows, ending and beginning inside one, and one of no tokens."""
    monkeypatch.setattr(kda_chunk, "WINDOW_CHUNKS", window)
    # under torch.compile the run is one window under autograd (a Function calling autograd breaks the graph)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    lengths = [10, 0, 65, 3, 22, 40]
    packed = layout != "batch"
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0))) if packed else None
    q, k, v, g, beta, h0 = make_inputs(
        B=1 if packed else 2,
        T=sum(lengths) if packed else 70,
        g=mixed_decay(-5.0),
        states=len(lengths) if packed else None,
    )
    results = []
    for fn, extra in ((naive_recurrent_kda, {}), (chunk_kda, {"chunk_size": 8})):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        state = None if layout == "packed_no_state" else inputs[5]
        o, s = fn(*inputs[:5], initial_state=state, output_final_state=True, cu_seqlens=cu, **extra)
        weight = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        ((o * weight).sum() + s.pow(2).sum()).backward()
        results.append([o, s] + [x.grad for x in inputs[: 5 if state is None else 6]])
    for name, a, b in zip("o s q k v g beta h0".split(), results[1], results[0]):
        assert rel(a, b) <= 1e-9, name


def test_fp32_backward_finite_at_strong_decay():
    q, k, v, g, beta, h0 = make_inputs(T=128, dtype=torch.float32, g=-5.0)
    g.requires_grad_()
    q.requires_grad_()
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    o.sum().backward()
    assert torch.isfinite(g.grad).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_intra_chunk_scores_on_every_path(dtype):
    """Blocks of mild, strong, extreme and mixed decay side by side, no bound: the split down to elementwise."""
    from moe_plugin.ops.kda.intra import intra_chunk_scores

    gen = torch.Generator().manual_seed(5)
    M, R, C, K = 5, 2, 16, 3
    steps = torch.tensor([-0.1, -5.0, -40.0, -1000.0, 0.0], dtype=torch.float64).view(M, 1, 1)
    g = steps * torch.rand(M, C, K, generator=gen, dtype=torch.float64)
    g[4, ::5] = -2000.0  # one block with sudden drops among no decay at all
    G = g.cumsum(1)
    rows = torch.randn(M, R, C, K, generator=gen, dtype=torch.float64)
    k = torch.randn(M, C, K, generator=gen, dtype=torch.float64)
    expected = torch.zeros(M, R, C, C, dtype=torch.float64)
    for c in range(C):
        for i in range(c + 1):
            expected[:, :, c, i] = (rows[:, :, c] * (k[:, i] * (G[:, c] - G[:, i]).exp()).unsqueeze(1)).sum(-1)
    rows_t, k_t = rows.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
    got = intra_chunk_scores(rows_t, k_t, G)
    assert got.dtype == dtype
    assert rel(got.double(), expected) <= (1e-6 if dtype == torch.float32 else 1e-13)
    got.square().sum().backward()
    assert torch.isfinite(rows_t.grad).all() and torch.isfinite(k_t.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bounded_gate_factorises_blocks_and_equals_recurrent(dtype):
    """K3's bound (-5 < g) in chunks of 64: fp32 factorises blocks of 16 (a span <= 75) inside one split, fp64
    the whole chunk (a span <= 315); both equal the recurrence, with gates at the bound's edge."""
    from moe_plugin.ops.kda.intra import factorised_block

    assert factorised_block(torch.float32, 5.0) == 22 and factorised_block(torch.float64, 5.0) == 171
    assert factorised_block(torch.float32, None) == 1
    edge = lambda shape, gen: -5.0 * torch.rand(shape, generator=gen, dtype=torch.float64).sqrt()  # noqa: E731
    q, k, v, g, beta, h0 = make_inputs(T=150, dtype=dtype, g=edge)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, gate_lower_bound=-5.0)
    assert rel(o, o_ref) <= TOL[dtype] and rel(s, s_ref) <= TOL[dtype]


def test_gate_lower_bound_checked_in_debug_mode(monkeypatch):
    """A gate below its promised bound is caught with MOE_PLUGIN_DEBUG_CHECKS=1 (naming the argument), and a
    bound that is no log decay always."""
    q, k, v, g, beta, _ = make_inputs(T=20, g=-6.0)
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match="gate_lower_bound=-5.0"):
        chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0)
    with pytest.raises(ValueError, match="gate_lower_bound: expected a number <= 0"):
        chunk_kda(q, k, v, g, beta, gate_lower_bound=2.0)
    o, _ = chunk_kda(q, k, v, g, beta, gate_lower_bound=-6.0)  # at the bound is within it
    assert rel(o, naive_recurrent_kda(q, k, v, g, beta)[0]) <= TOL[torch.float64]


# --- transformers' independent torch implementation -------------------------------------------------------


def _transformers_fns():
    mod = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    return inspect.unwrap(mod.recurrent_kimi_delta_attention), inspect.unwrap(mod.chunk_kimi_delta_attention)


@pytest.mark.parametrize("which", ["recurrent", "chunk"])
def test_equals_transformers(which):
    recurrent, chunk = _transformers_fns()
    q, k, v, g, beta, h0 = make_inputs(T=100, dtype=torch.float32, g=mixed_decay(-5.0))
    raw_q, raw_k = torch.randn_like(q) * 3, torch.randn_like(k) * 3  # they normalise inside; we do it first
    if which == "recurrent":
        o_ref, s_ref = recurrent(raw_q, raw_k, v, g, beta, h0.clone(), True, use_qk_l2norm_in_kernel=True)
    else:
        o_ref, s_ref = chunk(
            raw_q,
            raw_k,
            v,
            g,
            beta,
            chunk_size=32,
            initial_state=h0.clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    o, s = chunk_kda(l2norm(raw_q), l2norm(raw_k), v, g, beta, initial_state=h0, output_final_state=True)
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


# --- kernel choice ----------------------------------------------------------------------------------------


def test_gpu_kernel_used_when_on_cuda(monkeypatch):
    calls = {}

    def fake_kernel(**kwargs):
        calls.update(kwargs)
        return "o", "state"

    looked_up = []
    monkeypatch.setattr(backend, "on_cuda", lambda *tensors: True)
    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: looked_up.append((module, attr)) or fake_kernel)
    monkeypatch.delenv("MOE_PLUGIN_DISABLE_KERNELS", raising=False)
    q, k, v, g, beta, h0 = make_inputs(B=1, T=9)
    cu = torch.tensor([0, 4, 9])
    h0 = h0.expand(2, -1, -1, -1)
    assert chunk_kda(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu) == (
        "o",
        "state",
    )
    assert looked_up == [("fla.ops.kda", "chunk_kda")]
    assert calls["q"] is q and calls["k"] is k and calls["v"] is v and calls["g"] is g and calls["beta"] is beta
    assert calls["scale"] == 0.5 and calls["initial_state"] is h0 and calls["output_final_state"] is True
    assert calls["cu_seqlens"] is cu and calls["use_qk_l2norm_in_kernel"] is False


def test_l2norm_in_kernel_flag_equals_normalising_first():
    torch.manual_seed(3)
    q, k = torch.randn(2, 2, 37, 3, 16, dtype=torch.float64).unbind(0)
    _, _, v, g, beta, h0 = make_inputs(T=37)
    for fn in (chunk_kda, naive_recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, s_ref = fn(l2norm(q), l2norm(k), v, g, beta, initial_state=h0, output_final_state=True)
        assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12


def test_gpu_kernel_never_chosen_on_cpu(monkeypatch):
    def fake_kernel(**kwargs):
        raise AssertionError("the GPU kernel must not run for CPU tensors")

    monkeypatch.setattr(backend, "_import_attr", lambda module, attr: fake_kernel)
    q, k, v, g, beta, h0 = make_inputs(T=20)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert rel(o, o_ref) <= 1e-10


# --- gates and l2norm ------------------------------------------------------------------------------------


def test_gates_and_l2norm_match_elementwise_formulas():
    B, T, H, K = 1, 2, 2, 3
    f = torch.randn(B, T, H, K, dtype=torch.float64)
    A_log = torch.randn(H, dtype=torch.float64)
    dt_bias = torch.randn(H * K, dtype=torch.float64)
    g3 = kda_gate_k3(f, A_log, dt_bias, lower_bound=-4.0)
    gk = kda_gate_kimi_linear(f, A_log, dt_bias)
    for t in range(T):
        for h in range(H):
            for d in range(K):
                x = f[0, t, h, d].item() + dt_bias[h * K + d].item()
                rate = math.exp(A_log[h].item())
                assert g3[0, t, h, d].item() == pytest.approx(-4.0 / (1 + math.exp(-rate * x)), rel=1e-12)
                assert gk[0, t, h, d].item() == pytest.approx(-rate * math.log1p(math.exp(x)), rel=1e-12)
    assert kda_gate_k3(f.float(), A_log.float(), dt_bias.float()).dtype == torch.float32
    assert kda_gate_k3(f.bfloat16(), A_log.float(), dt_bias.float()).dtype == torch.float32
    x = torch.randn(3, 5, dtype=torch.float64)
    y = l2norm(x, eps=1e-3)
    for r in range(3):
        norm = math.sqrt(sum(v * v for v in x[r].tolist()) + 1e-3)
        assert rel(y[r], x[r] / norm) <= 1e-14


def test_gate_bad_input():
    f = torch.randn(1, 2, 2, 3)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate_k3(f, torch.zeros(3), torch.zeros(6))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate_kimi_linear(f, torch.zeros(2), torch.zeros(5))
    with pytest.raises(ValueError, match="^f:"):
        kda_gate_k3(f[0], torch.zeros(2), torch.zeros(6))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate_k3(f, torch.zeros(2), torch.zeros(6), lower_bound=1.0)


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda])
def test_bad_input_names_the_argument(fn):
    q, k, v, g, beta, h0 = make_inputs(B=2, T=8, dtype=torch.float32)
    cases = [
        ("^q:", dict(q=q[0])),
        ("^k:", dict(k=k[:, :, :, :3])),
        ("^v:", dict(v=v[:1])),
        ("^g:", dict(g=g[..., 0])),
        ("^beta:", dict(beta=beta[..., None])),
        ("k=torch.float64", dict(k=k.double())),
        ("^initial_state:", dict(initial_state=h0[:1])),
        ("^cu_seqlens:", dict(cu_seqlens=torch.tensor([0, 4, 8]))),
        ("^scale:", dict(scale=-1.0)),
    ]
    for pattern, change in cases:
        args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
        args.update(change)
        with pytest.raises(ValueError, match=pattern):
            fn(**args)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5])
def test_bad_chunk_size(chunk_size):
    q, k, v, g, beta, _ = make_inputs(T=8)
    with pytest.raises(ValueError, match="^chunk_size:"):
        chunk_kda(q, k, v, g, beta, chunk_size=chunk_size)
