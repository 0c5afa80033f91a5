from pathlib import Path

import pytest

from moe_plugin.models.base_tokenizer import chat_tokens, load_base_tokenizer
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.training.data.chat_template import IGNORE, expand_image_tokens, tokenize_chat

REPO = Path(__file__).resolve().parents[2]
BASES = {"byte": REPO / "recipes/bases/tiny-arith", "subword": REPO / "recipes/bases/tiny-subword"}
IMAGE = {"byte": "<|image|>", "subword": "<|media_pad|>"}

USER = {"role": "user", "content": "What is 37 - 12?"}
CONVERSATIONS = {
    "one turn": [USER, {"role": "assistant", "content": "25"}],
    "several turns": [
        USER,
        {"role": "assistant", "content": "25"},
        {"role": "user", "content": "And 9 + 4?"},
        {"role": "assistant", "content": "It is 13."},
        {"role": "user", "content": "What color is the shape?"},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ],
    "system turn": [
        {"role": "system", "content": "Answer with one word."},
        USER,
        {"role": "assistant", "content": "25"},
        {"role": "user", "content": "Which shape is this?"},
        {"role": "assistant", "content": "circle"},
    ],
    "image": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
        {"role": "assistant", "content": "yellow"},
    ],
}


@pytest.fixture(scope="module", params=sorted(BASES))
def base(request):
    return request.param, load_base_tokenizer(str(BASES[request.param]))


def render(tok, messages, add_generation_prompt=False):
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=True)["input_ids"]
    )


def answer_text(message):
    content = message["content"]
    return content if isinstance(content, str) else "".join(item["text"] for item in content)


def expected_labels(tok, messages):
    """Labels computed here from the template: after each prompt (with the generation prompt), the answer's
    own tokens and <|im_end|>; nothing else."""
    ids = render(tok, messages)
    labels = [IGNORE] * len(ids)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(tok, messages[:i], add_generation_prompt=True))
            answer = tok.encode(answer_text(message), add_special_tokens=False) + [im_end]
            labels[start : start + len(answer)] = answer
    return ids, labels


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_ids_and_labels_equal_the_templates_rendering(base, name):
    kind, tok = base
    messages = CONVERSATIONS[name]
    ids, labels = tokenize_chat(tok, messages, where="data/train.jsonl:3")
    assert (ids, labels) == expected_labels(tok, messages)
    assert max(ids) < len(tok) and len(ids) == len(labels)
    trained = [t for t in labels if t != IGNORE]
    answers = [answer_text(m) for m in messages if m["role"] == "assistant"]
    assert tok.decode(trained) == "".join(a + "<|im_end|>" for a in answers)
    assert [t for t in ids if t == tok.convert_tokens_to_ids(IMAGE[kind])] == [
        tok.convert_tokens_to_ids(IMAGE[kind])
    ] * (2 if name == "image" else 0)


def test_subword_ids_are_not_byte_ids():
    subword = load_base_tokenizer(str(BASES["subword"]))
    messages = CONVERSATIONS["several turns"]
    ids, _ = tokenize_chat(subword, messages, where="x")
    byte_ids, _ = tokenize_chat(ByteTokenizer(), messages, where="x")
    assert len(subword) < 256 and len(ids) < len(byte_ids) / 2
    assert subword.decode(ids) != ByteTokenizer().decode(ids)


def test_image_placeholder_in_an_answer_is_not_trained(base):
    kind, tok = base
    messages = [USER, {"role": "assistant", "content": [{"type": "text", "text": "25"}, {"type": "image"}]}]
    ids, labels = tokenize_chat(tok, messages, where="x")
    image_id = tok.convert_tokens_to_ids(IMAGE[kind])
    assert image_id in ids and labels[ids.index(image_id)] == IGNORE
    assert tok.decode([t for t in labels if t != IGNORE]).endswith("<|im_end|>")


def test_passing_chat_tokens_gives_the_same_result(base):
    _, tok = base
    messages = CONVERSATIONS["image"]
    assert tokenize_chat(tok, messages, where="x", tokens=chat_tokens(tok)) == tokenize_chat(tok, messages, where="x")


@pytest.mark.parametrize("content", ["", "   ", [{"type": "image"}], [{"type": "text", "text": ""}]])
def test_empty_answer_is_refused_naming_where(base, content):
    _, tok = base
    with pytest.raises(ValueError, match=r"^data/train.jsonl:7: messages\[1\] is an assistant turn with no text"):
        tokenize_chat(tok, [USER, {"role": "assistant", "content": content}], where="data/train.jsonl:7")


def test_no_assistant_turn_and_bad_messages_are_refused(base):
    _, tok = base
    with pytest.raises(ValueError, match=r"^row 4: has no assistant turn"):
        tokenize_chat(tok, [USER], where="row 4")
    with pytest.raises(ValueError, match=r"^row 4: messages\[0\] needs both 'role' and 'content'"):
        tokenize_chat(tok, [{"role": "user"}], where="row 4")
    with pytest.raises(ValueError, match=r"^row 4: needs a non-empty list of messages"):
        tokenize_chat(tok, [], where="row 4")


def test_template_error_is_refused_naming_where():
    tok = ByteTokenizer()  # its template raises on an item type it does not know
    messages = [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "no"}]
    with pytest.raises(ValueError, match=r"^a.jsonl:2: the chat template fails on messages\[:2\] .*video"):
        tokenize_chat(tok, messages, where="a.jsonl:2")


def test_template_whose_prompts_are_not_prefixes_is_refused():
    tok = load_base_tokenizer(str(BASES["subword"]))
    tokens = chat_tokens(tok)
    # newest message first: no prompt is the start of the conversation
    tok.chat_template = tok.chat_template.replace("for message in messages", "for message in messages|reverse")
    with pytest.raises(ValueError, match=r"^b.jsonl:5: the chat template does not render prompts as prefixes"):
        tokenize_chat(tok, CONVERSATIONS["several turns"], where="b.jsonl:5", tokens=tokens)
    with pytest.raises(ValueError, match=r"^model.from_pretrained: the chat template does not render the prompt"):
        chat_tokens(tok)


def test_turn_without_end_of_turn_is_refused():
    tok = load_base_tokenizer(str(BASES["subword"]))
    tokens = chat_tokens(tok)
    tok.chat_template = tok.chat_template.replace("{{ '<|im_end|>' }}", "{{ '\\n' }}")
    with pytest.raises(
        ValueError,
        match=r"^c.jsonl:1: messages\[1\] does not end with the template's end-of-turn "
        r"tokens '<\|im_end\|>'",
    ):
        tokenize_chat(tok, CONVERSATIONS["one turn"], where="c.jsonl:1", tokens=tokens)
    with pytest.raises(ValueError, match=r"^model.from_pretrained: the chat template writes no special token after"):
        chat_tokens(tok)


def test_no_chat_template_is_refused():
    tok = load_base_tokenizer(str(BASES["subword"]))
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"^model.from_pretrained: the base's tokenizer has no chat template"):
        chat_tokens(tok)


def test_expand_image_tokens(base):
    kind, tok = base
    ids, labels = tokenize_chat(tok, CONVERSATIONS["image"], where="x")
    image_id = tok.convert_tokens_to_ids(IMAGE[kind])
    big_ids, big_labels = expand_image_tokens(ids, labels, image_id, [4, 2], where="x")
    assert big_ids.count(image_id) == 6 and len(big_ids) == len(ids) + 4 == len(big_labels)
    assert [t for t in big_ids if t != image_id] == [t for t in ids if t != image_id]
    assert [t for t in big_labels if t != IGNORE] == [t for t in labels if t != IGNORE]
    first = big_ids.index(image_id)
    assert big_ids[first : first + 4] == [image_id] * 4 and big_ids[first + 4] != image_id
    with pytest.raises(ValueError, match=r"^d.jsonl:9: the conversation holds 2 image placeholders but 1 images"):
        expand_image_tokens(ids, labels, image_id, [4], where="d.jsonl:9")
