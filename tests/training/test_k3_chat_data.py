"""Chat data on a K3-style base (tests/fixtures/k3_tokenizer, loaded through trust_remote_code) and a K2.5-style
one (tests/fixtures/k25_tokenizer): the pipeline's ids are the tokenizer's own rendering token for token, and
its labels are each assistant turn as the rendering writes it, found here by splitting that rendering at its
end-of-message ids and decoding, independently of how the pipeline finds them."""

import json
import warnings
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_plugin.models.base_tokenizer import chat_tokens, k3_image_prompt
from moe_plugin.training.data.chat import chat_example, sft_examples
from moe_plugin.training.data.chat_template import IGNORE, tokenize_chat

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
K3_IDS = json.loads((FIXTURES / "k3_tokenizer" / "k3_token_ids.json").read_text())
K3_CONFIG = {"eos_token_id": K3_IDS["eos_token_id"], "media_placeholder_token_id": K3_IDS["media_placeholder_token_id"]}
ASSISTANT_HEADER = '<|open|>message role="assistant"<|sep|>'

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and London? I typed <|open|> and <|end_of_msg|> myself."},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I will call the tool twice.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "London", "days": 2, "metric": True}},
            },
            # arguments that are not JSON: the format writes them as a JSON block
            {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": "city=Rome"}},
        ],
    },
    # results out of call order: the format puts them back by tool_call_id
    {"role": "tool", "tool_call_id": "call_b", "name": "get_weather", "content": "rainy"},
    {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "Paris is sunny, London rainy.", "reasoning_content": "Both came back."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def k3():
    return AutoTokenizer.from_pretrained(FIXTURES / "k3_tokenizer", trust_remote_code=True, local_files_only=True)


@pytest.fixture(scope="module")
def k25():
    return AutoTokenizer.from_pretrained(FIXTURES / "k25_tokenizer", trust_remote_code=True, local_files_only=True)


def k3_rendering(tok, messages, **kwargs):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=True, **kwargs)
    (ids,) = out["input_ids"]  # K3's tokenizer returns a batch of one
    return ids


def k3_reference_labels(tok, ids, opener="<|open|>think<|sep|>"):
    """Labels from the rendering alone: split at <|end_of_msg|>; an assistant message is labelled from after
    its header and think opener through its <|end_of_msg|>."""
    end = tok.convert_tokens_to_ids("<|end_of_msg|>")
    labels, start = [IGNORE] * len(ids), 0
    for k, t in enumerate(ids):
        if t != end:
            continue
        chunk = ids[start : k + 1]
        if tok.decode(chunk).startswith(ASSISTANT_HEADER + opener):
            skip = next(n for n in range(len(chunk)) if tok.decode(chunk[:n]) == ASSISTANT_HEADER + opener)
            labels[start + skip : k + 1] = chunk[skip:]
        start = k + 1
    return labels


def test_k3_chat_tokens(k3):
    tokens = chat_tokens(k3, K3_CONFIG, generation_config={"eos_token_id": K3_IDS["eos_token_id"]})
    assert k3.chat_template is None
    assert k3.decode(list(tokens.end_of_turn)) == "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    assert set(tokens.stop_ids) == {K3_IDS["eos_token_id"], K3_IDS["tokenizer_eos_token_id"]}
    assert tokens.pad_id == K3_IDS["pad_token_id"]
    assert tokens.image_token_id == K3_IDS["media_placeholder_token_id"] and tokens.image_prompts


def test_k3_tool_chat_ids_and_labels_are_the_tokenizers_rendering(k3):
    tokens = chat_tokens(k3, K3_CONFIG)
    ids, labels = tokenize_chat(k3, TOOL_CHAT, where="x", tokens=tokens, tools=TOOLS)
    assert ids == k3_rendering(k3, TOOL_CHAT, tools=TOOLS)
    assert labels == k3_reference_labels(k3, ids)
    text = k3.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=False)
    # typed control-token text stays plain text: one fewer <|open|> / <|end_of_msg|> id than the text shows
    for marker in ("<|open|>", "<|end_of_msg|>"):
        assert ids.count(k3.convert_tokens_to_ids(marker)) == text.count(marker) - 1
    assert ids[: len(k3.encode(text, add_special_tokens=False))] != k3.encode(text, add_special_tokens=False)
    trained = k3.decode([t for t in labels if t != IGNORE])
    assert "I will call the tool twice." in trained and "Both came back." in trained
    assert '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument' in trained
    assert '<|open|>argument key="metric" type="boolean"<|sep|>true' in trained
    assert '<|open|>argument key="city" type="string"<|sep|>Paris' in trained
    assert '<|open|>call tool="get_weather" index="3"<|sep|><|open|>json type="object"<|sep|>city=Rome' in trained
    for untrained in (
        "Be brief.",
        "Weather in Paris",
        "sunny<|close|>",
        "rainy<|close|>",
        "# Tools",
        "thinking_effort",
    ):
        assert untrained not in trained
    # tool results back in call order: Paris's (index 1) first
    assert text.index('role="tool" tool="get_weather" index="1"<|sep|>sunny') < text.index('index="2"<|sep|>rainy')
    assert trained.count("<|end_of_msg|>") == 3


def test_k3_template_switches(k3):
    tokens = chat_tokens(k3, K3_CONFIG)
    chat = [TOOL_CHAT[1], TOOL_CHAT[5]]
    ids, labels = tokenize_chat(k3, chat, where="x", tokens=tokens, template_kwargs={"thinking_effort": "low"})
    assert ids == k3_rendering(k3, chat, thinking_effort="low") != k3_rendering(k3, chat)
    assert labels == k3_reference_labels(k3, ids)
    # thinking off: no think channel, so the reasoning is not rendered and is named
    found = []
    ids, labels = tokenize_chat(
        k3, chat, where="x", tokens=tokens, template_kwargs={"thinking": False}, unrendered=found
    )
    assert found == ["messages[1].reasoning_content"]
    assert ids == k3_rendering(k3, chat, thinking=False)
    assert labels == k3_reference_labels(k3, ids, opener="<|open|>response<|sep|>")  # the generation prompt's end
    with pytest.raises(ValueError, match=r"^x: the base's chat format does not render messages\[1\].reasoning_content"):
        tokenize_chat(k3, chat, where="x", tokens=tokens, template_kwargs={"thinking": False})


def test_k3_rejected_switch_is_named(k3, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [TOOL_CHAT[1], TOOL_CHAT[5]]}) + "\n")
    with pytest.raises(ValueError, match=r"^data.chat_template_kwargs: the base's chat format rejects .*medium"):
        sft_examples(str(path), k3, tokens=chat_tokens(k3, K3_CONFIG), template_kwargs={"thinking_effort": "medium"})


def test_k3_image_part(k3):
    tokens = chat_tokens(k3, K3_CONFIG)
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]},
        {"role": "assistant", "content": "red"},
    ]
    ids, labels = tokenize_chat(k3, chat, where="x", tokens=tokens, image_sizes=[(30, 20)])
    assert ids == k3_rendering(k3, chat, image_prompts=[k3_image_prompt(30, 20)])
    assert "<|media_begin|>image 30x20<|media_content|><|media_pad|><|media_end|>" in k3.decode(ids)
    pad = K3_IDS["media_placeholder_token_id"]
    assert ids.count(pad) == 1 and labels[ids.index(pad)] == IGNORE
    assert labels == k3_reference_labels(k3, ids)
    with pytest.raises(ValueError, match=r"^x: the conversation holds 1 images but 0 image sizes"):
        tokenize_chat(k3, chat, where="x", tokens=tokens)


def test_k3_sft_file_matches_the_rendering(k3, tmp_path):
    tokens = chat_tokens(k3, K3_CONFIG)
    records = [{"messages": TOOL_CHAT, "tools": TOOLS}, {"messages": [TOOL_CHAT[1], TOOL_CHAT[5]]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    examples = sft_examples(str(path), k3, tokens=tokens, tools=[TOOLS[0]])
    # the second record takes the recipe-wide tools
    assert examples[0].input_ids == k3_rendering(k3, TOOL_CHAT, tools=TOOLS)
    assert examples[1].input_ids == k3_rendering(k3, [TOOL_CHAT[1], TOOL_CHAT[5]], tools=[TOOLS[0]])
    for example in examples:
        assert example.labels == k3_reference_labels(k3, example.input_ids)
    assert examples[0] == chat_example(TOOL_CHAT, k3, tokens=tokens, tools=TOOLS)


def test_k25_defaults_to_a_generation_prompt_and_still_trains(k25):
    assert k25.apply_chat_template([TOOL_CHAT[1]], tokenize=False).endswith("<|im_middle|><think>")
    tokens = chat_tokens(k25)
    assert k25.decode(list(tokens.end_of_turn)) == "<|im_end|>"
    chat = [TOOL_CHAT[1], {"role": "assistant", "content": "sunny", "reasoning_content": "look"}]
    ids, labels = tokenize_chat(k25, chat, where="x", tokens=tokens)
    assert ids == k25.apply_chat_template(chat, add_generation_prompt=False)["input_ids"]
    assert k25.decode([t for t in labels if t != IGNORE]) == "look</think>sunny<|im_end|>"


def test_k25_history_reasoning_is_named(k25):
    tokens = chat_tokens(k25)
    chat = [
        {"role": "user", "content": "What color is the shape?"},
        {"role": "assistant", "content": "red", "reasoning_content": "look"},
        {"role": "user", "content": "And the background?"},
        {"role": "assistant", "content": "green", "reasoning_content": "again"},
    ]
    found = []
    ids, labels = tokenize_chat(k25, chat, where="x", tokens=tokens, unrendered=found)
    assert found == ["messages[1].reasoning_content"]
    assert ids == k25.apply_chat_template(chat, add_generation_prompt=False)["input_ids"]
    assert k25.decode([t for t in labels if t != IGNORE]) == "</think>red<|im_end|>again</think>green<|im_end|>"


def test_unrendered_fields_are_named_in_one_warning(tmp_path):
    from moe_plugin.models.tokenizer import ByteTokenizer

    record = {
        "messages": [
            {"role": "user", "content": "Hi", "weight": 0.5},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
        ]
    }
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = sft_examples(str(path), ByteTokenizer())
    (warning,) = [str(w.message) for w in caught if "not trained" in str(w.message)]
    assert warning.startswith("data.path: 2 records hold fields that the base's chat format does not render")
    assert "reasoning_content (first: messages[1].reasoning_content of line 1 of" in warning
    assert "weight (first: messages[0].weight of line 1" in warning
    assert "greet" not in ByteTokenizer().decode(examples[0].input_ids)


def test_k3_fixture_defaults_are_the_releases(k3):
    chat = [TOOL_CHAT[1]]
    text = k3.apply_chat_template(chat)  # tokenize=False, a generation prompt, thinking, effort max by default
    assert isinstance(text, str) and text.endswith(ASSISTANT_HEADER + "<|open|>think<|sep|>")
    assert '<|open|>message role="system" type="thinking-effort"<|sep|>' in text and "thinking_effort=max" in text
    assert k3.apply_chat_template(chat, thinking=False).endswith(ASSISTANT_HEADER + "<|open|>response<|sep|>")
    batch = k3.apply_chat_template([chat, chat], tokenize=True)
    assert len(batch) == 2 and batch[0] == batch[1] == k3.apply_chat_template(chat, tokenize=True)
    with pytest.raises(ValueError, match="thinking_effort must be one of"):
        k3.apply_chat_template(chat, thinking_effort="medium")
    assert k3.bos_token_id == K3_IDS["bos_token_id"] and k3.bos_token_id not in k3_rendering(k3, chat)


def test_openai_records_from_parquet_and_a_saved_dataset(k3, tmp_path):
    import datasets

    tokens = chat_tokens(k3, K3_CONFIG)
    # one shape for every row (what Arrow needs): arguments as JSON strings, content strings
    records = [
        {"messages": [TOOL_CHAT[1], {"role": "assistant", "content": "Yes.", "reasoning_content": "ok"}]},
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": ""},
            ]
        },
    ]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    want = sft_examples(str(jsonl), k3, tokens=tokens)
    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(saved))
    for path in (parquet, saved):
        got = sft_examples(str(path), k3, tokens=tokens)
        assert got == want and got[0].where == f"row 1 of {path}"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^data.path: .*empty is a directory but not a dataset written by"):
        sft_examples(str(tmp_path / "empty"), k3, tokens=tokens)


def test_recipe_data_tools_and_switches(tmp_path):
    from moe_plugin.recipe.schema import recipe_from_dict
    from tests.recipes import smallest

    path = tmp_path / "chats.jsonl"
    path.write_text("{}\n")
    sft = {"kind": "sft", "path": str(path), "tools": TOOLS, "chat_template_kwargs": {"thinking": False}}
    data = recipe_from_dict(smallest(data=sft)).data
    assert data.tools == TOOLS and data.chat_template_kwargs == {"thinking": False}
    assert recipe_from_dict(smallest(data={"kind": "sft", "path": str(tmp_path)})).data.path == str(tmp_path)
    with pytest.raises(ValueError, match=r"data.tools: is read only when data.kind is \"sft\""):
        recipe_from_dict(smallest(data={"kind": "text", "path": str(path), "tools": TOOLS}))
    with pytest.raises(ValueError, match=r"data.chat_template_kwargs"):
        recipe_from_dict(smallest(data={"kind": "sft", "path": str(path), "chat_template_kwargs": ["thinking"]}))


def test_a_message_the_template_ignores_is_named():
    from moe_plugin.models.tokenizer import CHAT_TEMPLATE, ByteTokenizer

    tok = ByteTokenizer()
    # a template that leaves system messages out, as some do
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{% for message in messages %}", "{% for message in messages if message['role'] != 'system' %}"
    )
    chat = [{"role": "system", "content": "Be brief."}, *TOOL_CHAT[-2:]]
    found = []
    ids, labels = tokenize_chat(tok, chat, where="x", unrendered=found)
    assert found == ["messages[0]"]
    assert ids == tok.apply_chat_template(chat, add_generation_prompt=False, return_dict=True)["input_ids"]
    assert tok.decode([t for t in labels if t != IGNORE]) == "You are welcome.<|im_end|>"


def test_ids_in_every_shape_a_template_returns():
    import torch
    from transformers import BatchEncoding

    from moe_plugin.models.base_tokenizer import ids_of

    for shape in (
        [5, 6],
        [[5, 6]],
        torch.tensor([[5, 6]]),
        {"input_ids": [5, 6]},
        BatchEncoding({"input_ids": [[5, 6]]}),
    ):
        assert ids_of(shape) == [5, 6]
    with pytest.raises(ValueError, match="returned 2 rows for one conversation"):
        ids_of([[1], [2]])
    with pytest.raises(ValueError, match="returned str, not token ids"):
        ids_of("text")


def test_a_switch_that_changes_nothing_is_named(k3, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [TOOL_CHAT[1], TOOL_CHAT[5]]}) + "\n")
    tokens = chat_tokens(k3, K3_CONFIG)
    with pytest.warns(UserWarning, match=r"^data.chat_template_kwargs: thinkng=False changes nothing") as caught:
        sft_examples(str(path), k3, tokens=tokens, template_kwargs={"thinkng": False, "thinking_effort": "low"})
    assert not [w for w in caught if "thinking_effort" in str(w.message)]
