"""The sequence-wise balance loss in the Hugging Face model's training loss (models/modeling.py, layers/moe.py):
each MoE layer's term equals DeepSeek-V3's formula written here from the router's probabilities and choices, per
packed document of unequal length, padding left out; its gradient reaches the router adapter's lora_A and lora_B
and nothing frozen; a padded batch gives what the same documents packed give."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM

COEFF = 0.5
CU = torch.tensor([0, 3, 14, 14, 30])  # documents of 3, 11, 0 and 16 tokens


@pytest.fixture(scope="module")
def adapted():
    torch.manual_seed(0)
    base = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", moe_intermediate_size=24))
    assert base.config.to_model_config().moe.num_groups == 1  # the choice below is a plain top-k
    with torch.no_grad():
        for name, buffer in base.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)  # choices made with a bias differ from the top scores
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate"], init_lora_weights=False)
    torch.manual_seed(5)  # init_lora_weights=False: lora_B is random, so lora_A has a gradient from the start
    model = get_peft_model(base, config)
    model.get_base_model().router_aux_loss_coeff = COEFF
    return model.train()


def _moe_layers(model):
    return [layer.block_sparse_moe for layer in model.get_base_model().model.layers if layer.is_moe]


def _captured_logits(model):
    """Forward hooks keeping every MoE gate's output logits ``[N, E]`` (the adapted router's) per call."""
    seen, handles = [], []
    for layer in _moe_layers(model):
        handles.append(layer.gate.register_forward_hook(lambda m, i, out, layer=layer: seen.append((layer, out))))
    return seen, handles


def _formula(logits, bias, top_k, doc_of, weight_of):
    """sum_d w_d sum_i f_di P_di from the definition: s = sigmoid(logits); each token chooses the top k of
    s + bias; for document d with T_d tokens, f_di = E / (k T_d) * (choices of i), P_di = mean_t s_ti / sum_j s_tj."""
    s = torch.sigmoid(logits.double())
    choices = torch.topk(s + bias.double(), top_k, dim=-1).indices
    e, total = s.shape[1], 0.0
    for d, w in weight_of.items():
        tokens = [t for t in range(s.shape[0]) if doc_of[t] == d]
        if not tokens or w == 0:
            continue
        term = 0.0
        for i in range(e):
            count = sum(int(i in choices[t].tolist()) for t in tokens)
            p = sum(float(s[t, i] / s[t].sum()) for t in tokens) / len(tokens)
            term += e / (top_k * len(tokens)) * count * p
        total += w * term
    return total


def _packed_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 30), generator=g)
    labels = ids.clone()
    labels[0, 3:9] = -100  # a prompt in document 1: only its last 5 tokens are scored
    labels[0, 26:] = -100
    return ids, labels


def test_each_layer_term_equals_the_formula_per_document(adapted):
    ids, labels = _packed_batch()
    seen, handles = _captured_logits(adapted)
    try:
        out = adapted(input_ids=ids, labels=labels, cu_seqlens=CU)
    finally:
        for h in handles:
            h.remove()
    # scored labels (not -100, not a document's first token): 2, 5, 0, 11 of 18
    doc_of = {t: d for d in range(4) for t in range(int(CU[d]), int(CU[d + 1]))}
    weight_of = {0: 2 / 18, 1: 5 / 18, 2: 0.0, 3: 11 / 18}
    assert out.balance_loss.shape == (len(seen),) == (3,)
    for (layer, logits), got in zip(seen, out.balance_loss):
        want = _formula(
            logits.detach(), layer.router.e_score_correction_bias, layer.moe_config.top_k, doc_of, weight_of
        )
        assert float(got.detach()) == pytest.approx(want, rel=1e-5)
    with torch.no_grad():
        adapted.get_base_model().router_aux_loss_coeff = 0.0
        plain = adapted(input_ids=ids, labels=labels, cu_seqlens=CU)
        adapted.get_base_model().router_aux_loss_coeff = COEFF
    assert plain.balance_loss is None
    assert float(out.loss) == pytest.approx(float(plain.loss) + COEFF * float(out.balance_loss.sum()), rel=1e-6)


def test_gradient_reaches_the_router_adapter_and_nothing_frozen(adapted):
    ids, labels = _packed_batch()
    adapted.zero_grad(set_to_none=True)
    base = adapted.get_base_model()
    biases = {n: b.clone() for n, b in base.named_buffers() if n.endswith("e_score_correction_bias")}
    out = adapted(input_ids=ids, labels=labels, cu_seqlens=CU)
    out.balance_loss.sum().backward()  # the balance term alone
    named = dict(adapted.named_parameters())
    router = [n for n in named if ".block_sparse_moe.gate.lora_" in n]
    assert {n.split(".block_sparse_moe.gate.")[1].split(".")[0] for n in router} == {"lora_A", "lora_B"}
    for name in router:
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
    frozen = [n for n, p in named.items() if not p.requires_grad]
    assert frozen and all(named[n].grad is None for n in frozen)
    assert all(".lora_" in n for n, p in named.items() if p.grad is not None)
    for name, before in biases.items():  # the selection bias is a buffer: the term never moves it
        assert torch.equal(dict(base.named_buffers())[name], before)
    adapted.zero_grad(set_to_none=True)


def test_padded_rows_equal_the_packed_documents(adapted):
    """Two rows, one right-padded (attention_mask, as a training collator pads), are two documents: the same terms
    as packing their real tokens with cu_seqlens; the padding is neither routed into the term nor weighed."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 256, (9,), generator=g), torch.randint(0, 256, (6,), generator=g)
    pad = 0
    ids = torch.stack([a, torch.cat([b, torch.full((3,), pad)])])
    mask = torch.stack([torch.ones(9, dtype=torch.long), torch.tensor([1] * 6 + [0, 0, 0])])
    padded = adapted(input_ids=ids, attention_mask=mask, labels=ids.clone())
    packed = adapted(
        input_ids=torch.cat([a, b]).unsqueeze(0),
        labels=torch.cat([a, b]).unsqueeze(0),
        cu_seqlens=torch.tensor([0, 9, 15]),
    )
    assert torch.allclose(padded.balance_loss, packed.balance_loss, rtol=1e-5, atol=1e-7)


def test_no_term_in_evaluation_or_without_labels(adapted):
    ids, labels = _packed_batch()
    assert adapted(input_ids=ids, cu_seqlens=CU).balance_loss is None  # no labels: no training loss
    model = copy.deepcopy(adapted).eval()
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels, cu_seqlens=CU).balance_loss is None
