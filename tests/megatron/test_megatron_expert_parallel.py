"""megatron-core's own MoELayer (alltoall dispatcher, local experts) at EP=2 on gloo vs EP=1 and a per-token loop.

The ranks run in ep_workers.py (one launch for all checks, see conftest.py); the reference is computed here.
Each EP rank holds only its own experts, so an expert's gradient on its EP rank must equal the gradient the
global tokens (both ranks' tokens) give it on one device.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.distributed  # every test here starts processes

TOL = 1e-5
SCENARIOS = ("mixed", "starved", "one_expert")
TOP_K = {"mixed": 2, "starved": 2, "one_expert": 1}


def loop_moe(x, router, fc1, fc2, top_k):
    """Per token: sigmoid scores, top-k (renormalised when k > 1), sum_k w_k fc2_e(silu(a) * b), [a; b] = fc1_e x."""
    rows = []
    for t in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(router @ t)
        chosen = torch.topk(scores, top_k).indices
        w = scores[chosen] / scores[chosen].sum() if top_k > 1 else scores[chosen]
        y = torch.zeros_like(t)
        for wk, e in zip(w, chosen.tolist()):
            a, b = (fc1[e] @ t).chunk(2)
            y = y + wk * (fc2[e] @ (F.silu(a) * b))
        rows.append(y)
    return torch.stack(rows).view_as(x)


def reference(ranks, top_k):
    """Loop outputs and gradients per rank, with expert gradients also summed over the ranks' tokens."""
    weights = ranks[0]["weights"]
    per_rank, fc1_sum, fc2_sum = [], 0, 0
    for r in ranks:
        leaves = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
        x = r["x"].clone().requires_grad_(True)
        y = loop_moe(x, leaves["router"], leaves["fc1"], leaves["fc2"], top_k)
        (y * r["grad_out"]).sum().backward()
        per_rank.append({"y": y.detach(), "x_grad": x.grad, "router_grad": leaves["router"].grad})
        fc1_sum, fc2_sum = fc1_sum + leaves["fc1"].grad, fc2_sum + leaves["fc2"].grad
    return per_rank, fc1_sum, fc2_sum


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ep2_matches_ep1_and_loop(ep_check, rel_err, scenario):
    ranks = ep_check(f"moe/{scenario}")
    ref, fc1_sum, fc2_sum = reference(ranks, TOP_K[scenario])
    for rank, (got, want) in enumerate(zip(ranks, ref)):
        for tag in ("ep", "ep1"):
            run = got[tag]
            for key in ("y", "x_grad", "router_grad"):
                err = rel_err(run[key], want[key])
                assert err < TOL, f"rank {rank} {tag} {key}: rel err {err:.2e} vs the per-token loop"
        assert got["ep"]["local"] == [2 * rank, 2 * rank + 1], "EP=2 must split 4 experts 2 per rank"
        assert got["ep1"]["local"] == [0, 1, 2, 3]
        local = got["ep"]["local"]
        # An EP rank's experts see the tokens of every rank: their gradients are the global sums.
        for key, total in (("fc1_grad", fc1_sum), ("fc2_grad", fc2_sum)):
            err = rel_err(got["ep"][key], total[local])
            assert err < TOL, f"rank {rank} EP=2 {key} of experts {local}: rel err {err:.2e} vs the global sum"
        err = rel_err(got["ep"]["y"], got["ep1"]["y"])
        assert err < TOL, f"rank {rank}: EP=2 output differs from EP=1 by rel err {err:.2e}"


def test_starved_expert_gets_no_tokens_on_its_rank(ep_check):
    ranks = ep_check("moe/starved")
    sent = sum(r["ep"]["sent"] for r in ranks)
    assert sent[3] == 0 and (sent[:3] > 0).all(), f"scenario premise broken: tokens per expert {sent.tolist()}"
    received = ranks[1]["ep"]["received"]
    assert len(received) == 1 and received[0].tolist() == [int(sent[2]), 0], (
        f"EP rank 1 should compute expert 2 only, got tokens per local expert {received}"
    )


def test_all_tokens_to_one_expert(ep_check):
    ranks = ep_check("moe/one_expert")
    n_tokens = sum(r["x"].shape[0] * r["x"].shape[1] for r in ranks)
    sent = sum(r["ep"]["sent"] for r in ranks)
    assert sent.tolist() == [0, 0, n_tokens, 0], f"scenario premise broken: tokens per expert {sent.tolist()}"
    assert [t.tolist() for t in ranks[0]["ep"]["received"]] == [[0, 0]], "EP rank 0 must receive no tokens"
    assert [t.tolist() for t in ranks[1]["ep"]["received"]] == [[n_tokens, 0]]
    assert float(ranks[0]["ep"]["fc1_grad"].abs().sum()) == 0.0, "experts that saw no token must get zero grads"


def test_expert_rng_stream_differs_per_ep_rank(ep_check):
    ranks = ep_check("rng")
    assert not torch.equal(ranks[0]["expert"], ranks[1]["expert"]), "expert-parallel RNG must differ per EP rank"
    assert torch.equal(ranks[0]["model"], ranks[1]["model"]), "tensor-parallel RNG must agree at TP rank 0"
    assert not torch.equal(ranks[0]["model"], ranks[0]["model_next"]), "a forked stream must advance"


def test_ep_size_must_divide_world(ep_check):
    for got in ep_check("bad_ep_size"):
        assert got["message"] is not None and got["message"].startswith("expert_model_parallel_size"), got
