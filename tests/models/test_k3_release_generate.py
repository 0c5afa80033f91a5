"""Text-only ``generate`` on the tiny Kimi K3 release (``moe_plugin.testing.k3_release``) loaded as downloaded,
in its stored bf16 with the fp32 families (KDA's ``A_log`` / ``dt_bias``, the router's weight): the cached
one-token decoding step (KDA's recurrent form, fed by the fp32 gate) hands bf16 activations to the bf16
projections, and the decoded logits equal the same model's fp32 full forwards over the generated sequence
(no cache: an independent path) within bf16 rounding; where fp32's top choice leads clearly, bf16's greedy
token is the same."""

import os

import pytest
import torch

import moe_plugin  # noqa: F401  (registers the Auto classes)
from moe_plugin.testing.k3_release import write_k3_release

TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "k3_tokenizer")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_release_generate") / "base"
    write_k3_release(path, tokenizer_dir=TOKENIZER)
    return str(path)


def test_bf16_generate_with_the_fp32_families_follows_the_fp32_model(base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stored = AutoModelForCausalLM.from_pretrained(base).eval()  # the config's dtype: bf16
    assert stored.dtype == torch.bfloat16
    kept = {n for n, p in stored.named_parameters() if p.dtype == torch.float32}
    assert any(n.endswith("self_attn.A_log") for n in kept) and any(n.endswith("dt_bias") for n in kept)
    wide = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=True)
    ids = torch.tensor([tokenizer.encode("The sky is blue and the grass is green.")])
    out = stored.generate(
        input_ids=ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        min_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, ids.shape[1] :]
    assert out.sequences.shape[1] == ids.shape[1] + NEW_TOKENS
    decoded = torch.stack(out.logits, dim=1)[0].float()  # [NEW_TOKENS, vocab], the cached steps' logits
    with torch.no_grad():
        full = wide(input_ids=out.sequences[:, :-1], use_cache=False).logits[0, ids.shape[1] - 1 :].float()
    assert full.shape == decoded.shape
    rel = ((decoded - full).norm(dim=-1) / full.norm(dim=-1)).max().item()
    assert rel <= 6e-2, rel  # bf16 weights and activations against fp32 (a wrong cast or state is O(1))
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2 * full.std(dim=-1)  # well above bf16 rounding (rel ~2.5 %)
    assert clear.any(), (top2[:, 0] - top2[:, 1]) / full.std(dim=-1)
    assert torch.equal(new[clear], full.argmax(-1)[clear]), (new, full.argmax(-1))


def test_the_release_generation_config_is_read_and_placeholders_stay_suppressed(base, tmp_path):
    """Loaded as downloaded, the model generates with the checkpoint's ``generation_config.json`` (its stop ids
    and sampling defaults, here two stop ids and a temperature that config.json does not carry), as
    transformers' from_pretrained reads it for any checkpoint; the image+text model also never emits the media
    placeholder, also after a save and reload (the file written then replaces the config the model's
    ``__init__`` made)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    release = tmp_path / "release"
    shutil.copytree(base, release)
    generation = json.loads((release / "generation_config.json").read_text())
    tokens = json.loads((release / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    second_stop = next(int(i) for i, t in tokens.items() if t["content"] == "[EOS]")
    stop = [generation["eos_token_id"], second_stop]
    generation.update(eos_token_id=stop, do_sample=True, temperature=0.6)
    (release / "generation_config.json").write_text(json.dumps(generation))
    placeholder = json.loads((release / "config.json").read_text())["media_placeholder_token_id"]
    text = AutoModelForCausalLM.from_pretrained(release)
    assert (text.generation_config.eos_token_id, text.generation_config.temperature) == (stop, 0.6)
    image_text = AutoModelForImageTextToText.from_pretrained(release)
    assert (image_text.generation_config.eos_token_id, image_text.generation_config.temperature) == (stop, 0.6)
    assert placeholder in image_text.generation_config.suppress_tokens
    image_text.save_pretrained(tmp_path / "saved")
    saved = GenerationConfig.from_pretrained(tmp_path / "saved")
    saved.suppress_tokens = None  # a file without the rule, as an export that copies the base's writes it
    saved.save_pretrained(tmp_path / "saved")
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved")
    assert again.generation_config.eos_token_id == stop
    assert placeholder in again.generation_config.suppress_tokens
