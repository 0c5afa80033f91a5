"""generate(): greedy decoding with the cache equals recomputing the whole prefix; one new token per step."""

import numpy as np
import pytest
import torch
from PIL import Image

import moe_plugin
from moe_plugin.models import MoEPluginForCausalLM, MoEPluginForConditionalGeneration, MoEProcessor
from moe_plugin.models.image_processing import ImageProcessor

NEW_TOKENS = 6


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record_input_lengths(model):
    """Forward pre-hook recording the [B, T] shape of every input_ids the model is called with."""
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes, handle


def greedy(model, use_cache, **inputs):
    out = model.generate(
        **inputs,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=use_cache,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, dim=1)  # raw logits (scores hold -inf)


def check_cached_equals_recomputed(model, **inputs):
    prompt = inputs["input_ids"]
    shapes, handle = record_input_lengths(model)
    try:
        cached, cached_scores = greedy(model, True, **inputs)
    finally:
        handle.remove()
    recomputed, recomputed_scores = greedy(model, False, **inputs)
    assert cached.shape == (prompt.shape[0], prompt.shape[1] + NEW_TOKENS)
    assert torch.equal(cached, recomputed)
    assert rel(cached_scores, recomputed_scores) < 1e-5
    # the prefill sees the whole prompt, then every step feeds exactly one new token per row
    assert shapes[0] == tuple(prompt.shape)
    assert shapes[1:] == [(prompt.shape[0], 1)] * (NEW_TOKENS - 1)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # the indexer's top-k (64) covers every key: dense
        dict(index_topk=8, attn_res=False),  # sparse selection from the cached index keys; the plain residual
        dict(use_dsa_indexer=False, hidden_act="swiglu", routed_expert_hidden_size=None),
    ],
)
def test_text_generate_with_cache_equals_recompute(overrides):
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", **overrides)).eval()
    prompt = torch.randint(3, 256, (2, 37))  # more than one KDA chunk (32) in the prefill
    check_cached_equals_recomputed(model, input_ids=prompt)


def test_generate_continues_like_greedy_forward():
    """Independent of generate(): argmax over full forwards, one token at a time."""
    torch.manual_seed(3)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny")).eval()
    ids = torch.randint(3, 256, (1, 11))
    generated, _ = greedy(model, True, input_ids=ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)


def image(height, width, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl_model():
    torch.manual_seed(1)
    # the vocabulary of the offline tokenizer (272 ids), so that every generated id decodes
    return MoEPluginForConditionalGeneration(moe_plugin.preset_config("tiny", vocab_size=272, index_topk=16)).eval()


@pytest.fixture(scope="module")
def processor():
    return MoEProcessor(image_processor=ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16))


def test_image_text_generate_from_processor_output(vl_model, processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text, images=[image(56, 84, 0)])
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_patches", "grid_hw"}
    assert int((inputs["input_ids"] == vl_model.config.image_token_id).sum()) == 6
    check_cached_equals_recomputed(vl_model, **inputs)
    generated, _ = greedy(vl_model, True, **inputs)
    assert not (generated[:, inputs["input_ids"].shape[1] :] == vl_model.config.image_token_id).any()
    # the image matters: another image changes what the model predicts
    other = processor(text, images=[image(56, 84, 1)])
    _, scores = greedy(vl_model, True, **inputs)
    _, other_scores = greedy(vl_model, True, **other)
    assert rel(other_scores, scores) > 1e-3
    assert isinstance(processor.batch_decode(greedy(vl_model, True, **inputs)[0])[0], str)


def test_image_text_generate_two_images_per_prompt(vl_model, processor):
    inputs = processor("<|image|> then <|image|>: compare", images=[image(28, 56, 2), image(56, 28, 3)])
    check_cached_equals_recomputed(vl_model, **inputs)


def test_right_padded_prompts_with_cache_are_refused_by_name():
    """Left padding is generate's layout and is supported (below); right padding with a cache is refused."""
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny")).eval()
    ids = torch.randint(3, 256, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_beam_search_with_cache_equals_recompute():
    torch.manual_seed(4)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", index_topk=8)).eval()
    prompt = torch.randint(3, 256, (2, 10))
    beams = [
        model.generate(
            prompt, max_new_tokens=NEW_TOKENS, num_beams=3, do_sample=False, use_cache=use_cache, pad_token_id=0
        )
        for use_cache in (True, False)
    ]
    assert torch.equal(beams[0], beams[1])


def left_pad(prompts, pad_id=0):
    """Prompts (1-D id tensors) -> (input_ids [B, T], attention_mask [B, T]) padded on the left."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, length - len(p) :] = p
        mask[row, length - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize(
    "overrides",
    [
        dict(index_topk=8),  # top-k smaller than the prompts: sparse selection must skip the pad keys
        dict(use_dsa_indexer=False, attn_res=False),  # dense MLA attention
    ],
)
def test_left_padded_batch_generates_each_prompt_as_alone(overrides):
    torch.manual_seed(5)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny", **overrides)).eval()
    # lengths across the KDA chunk (32) and below the conv window, so padding shifts chunk boundaries
    prompts = [torch.randint(3, 256, (n,)) for n in (37, 2, 19)]
    ids, mask = left_pad(prompts)
    batched, batched_scores = greedy(model, True, input_ids=ids, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        alone, alone_scores = greedy(model, True, input_ids=prompt[None])
        assert torch.equal(batched[row, ids.shape[1] :], alone[0, len(prompt) :]), row
        assert rel(batched_scores[row], alone_scores[0]) < 1e-5, row
        with torch.no_grad():
            last = model(input_ids=prompt[None]).logits[0, -1]
        assert rel(batched_scores[row, 0], last) <= 1e-5, row  # the first step's logits
    # the packed path (no cache) on the same padded batch gives the same tokens
    recomputed, recomputed_scores = greedy(model, False, input_ids=ids, attention_mask=mask)
    assert torch.equal(batched, recomputed)
    assert rel(batched_scores, recomputed_scores) < 1e-5


def test_left_padded_expert_load_counts_real_tokens_only():
    torch.manual_seed(6)
    model = MoEPluginForCausalLM(moe_plugin.preset_config("tiny")).eval()
    prompts = [torch.randint(3, 256, (n,)) for n in (9, 4)]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=True).expert_load
        alone = sum(model(input_ids=p[None], use_cache=True).expert_load for p in prompts)
    assert torch.equal(padded, alone)
    assert padded.sum(1).eq(13 * model.config.num_experts_per_token).all()


def test_left_padded_image_text_generate_as_alone(vl_model, processor):
    texts = ["<|image|> what is it?", "a much longer question without an image but many words in it"]
    alone = [processor(texts[0], images=[image(28, 28, 4)]), processor(texts[1])]
    ids, mask = left_pad([a["input_ids"][0] for a in alone], pad_id=0)
    batched, batched_scores = greedy(
        vl_model,
        True,
        input_ids=ids,
        attention_mask=mask,
        pixel_patches=alone[0]["pixel_patches"],
        grid_hw=alone[0]["grid_hw"],
    )
    for row, inputs in enumerate(alone):
        tokens, scores = greedy(vl_model, True, **inputs)
        assert torch.equal(batched[row, ids.shape[1] :], tokens[0, inputs["input_ids"].shape[1] :]), row
        assert rel(batched_scores[row], scores[0]) < 1e-5, row
