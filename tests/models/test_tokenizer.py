import random

import pytest

from moe_plugin.models.tokenizer import SPECIAL_TOKENS, ByteTokenizer


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def random_text(rng, n):
    # ASCII, Latin-1, CJK, combining marks, emoji (astral plane, with skin-tone and ZWJ sequences), controls.
    pools = [(0x20, 0x7E), (0xA0, 0xFF), (0x4E00, 0x4FFF), (0x0300, 0x036F), (0x1F300, 0x1FAFF), (0x0, 0x1F)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars) + "👩‍👩‍👧‍👦 👋🏽"


def test_vocab_layout(tok):
    assert tok.vocab_size == 272 == len(tok)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(256, 256 + len(SPECIAL_TOKENS)))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.image_token_id) == (256, 257, 258, 259)


def test_round_trip_arbitrary_utf8(tok):
    rng = random.Random(0)
    for n in (0, 1, 7, 200):
        text = random_text(rng, n)
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))  # plain text is exactly its UTF-8 bytes
        assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_and_round_trip(tok):
    text = "<|im_start|>user\nhé <|image|><|image|> 🙂<|im_end|>"
    ids = tok.encode(text)
    want = (
        [tok.convert_tokens_to_ids("<|im_start|>")]
        + list("user\nhé ".encode())
        + [tok.image_token_id] * 2
        + list(" 🙂".encode())
        + [tok.convert_tokens_to_ids("<|im_end|>")]
    )
    assert ids == want
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhé  🙂"


def test_padding_and_attention_mask(tok):
    out = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert out["input_ids"].tolist() == [[97, 98, 256, 256], [97, 98, 99, 100]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    want = (
        "<|bos|>"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|image|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == want
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode(prompt)) == prompt


def test_save_and_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = ByteTokenizer.from_pretrained(tmp_path)
    text = "<|bos|>héllo 👋 <|image|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template and len(loaded) == len(tok)


def test_added_tokens_survive_save_and_load(tmp_path):
    tok = ByteTokenizer()
    tok.add_tokens(["<|tool|>"], special_tokens=True)
    assert tok.convert_tokens_to_ids("<|tool|>") == 272 and len(tok) == 273 and tok.vocab_size == 272
    tok.save_pretrained(tmp_path)
    loaded = ByteTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("a<|tool|>") == [97, 272] and loaded.image_token_id == 259


def test_out_of_range_id_raises(tok):
    with pytest.raises(ValueError, match="token id"):
        tok.decode([97, 5000])
