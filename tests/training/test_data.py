"""SFT data: chat masks against hand-computed layouts, file errors naming file and line, packing that leaves
the loss unchanged, resumable and data-parallel-consistent step batches, a stable held-out split."""

import json
import math
import random
import re
from types import SimpleNamespace

import pytest
import torch

from moe_plugin.models import MoEPluginForCausalLM, preset_config
from moe_plugin.ops.losses import causal_lm_loss
from moe_plugin.models.tokenizer import ByteTokenizer
from moe_plugin.training.data.pipeline import (
    Example,
    StepBatches,
    arithmetic_documents,
    arithmetic_examples,
    chat_example,
    eval_batches,
    label_token_count,
    load_examples,
    pack_examples,
    sft_examples,
    text_examples,
)

BOS, EOS, PAD, IM_START, IM_END = 257, 258, 256, 260, 261
TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
]


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def chat(i):
    return {
        "messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": f"{i + 1}."}]
    }


def test_two_turn_chat_layout_and_mask_exact(tok):
    ids, labels = [], []

    def put(part, trained=False):
        new = [part] if isinstance(part, int) else list(part.encode())
        ids.extend(new)
        labels.extend(new if trained else [-100] * len(new))

    put(BOS)
    put(IM_START), put("system\nBe brief."), put(IM_END), put("\n")
    put(IM_START), put("user\nHi"), put(IM_END), put("\n")
    put(IM_START), put("assistant\n"), put("Hello!", True), put(IM_END, True), put("\n")
    put(IM_START), put("user\n2+2?"), put(IM_END), put("\n")
    put(IM_START), put("assistant\n"), put("4", True), put(IM_END, True), put("\n")
    example = chat_example(TWO_TURNS, tok)
    assert example.input_ids == ids
    assert example.labels == labels
    assert tok.decode([t for t in example.labels if t != -100]) == "Hello!<|im_end|>4<|im_end|>"


def test_sft_file_reads_chats_and_skips_empty_lines(tmp_path, tok):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}, "", "   ", chat(3)])
    examples = sft_examples(path, tok)
    assert len(examples) == 2
    assert examples[0] == chat_example(TWO_TURNS, tok)
    assert tok.decode([t for t in examples[1].labels if t != -100]) == "4.<|im_end|>"


BAD_CHATS = [
    ('{"messages": [', "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"text": "no messages"}, "non-empty 'messages' list"),
    ({"messages": [{"role": "user"}]}, "messages[0] needs both 'role' and 'content'"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "has no assistant turn"),
    (
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
        "messages[0].content must be a string or a list",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        "the conversation holds 1 <|image|> placeholders but 0 images",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "x"}]},
        "messages[0].content[0] must be",
    ),
]


@pytest.mark.parametrize("bad,fragment", BAD_CHATS)
def test_bad_chat_lines_name_file_and_line(tmp_path, tok, bad, fragment):
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(1), "", bad, chat(2)])
    with pytest.raises(ValueError) as err:
        sft_examples(path, tok)
    message = str(err.value)
    assert message.startswith(f"data.path: line 3 of {path}: ")
    assert fragment in message


def test_bad_text_line_names_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"body": "no text field"}])
    with pytest.raises(
        ValueError, match=re.escape(f"data.path: line 2 of {path}: needs an object with a string field 'text'")
    ):
        text_examples(path, tok)


def test_unsupported_and_missing_files_are_named(tmp_path, tok):
    (tmp_path / "docs.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"data\.path: .*docs\.txt: unsupported file type '\.txt'"):
        text_examples(str(tmp_path / "docs.txt"), tok)
    with pytest.raises(ValueError, match=r"data\.path: no such file: .*absent\.jsonl"):
        sft_examples(str(tmp_path / "absent.jsonl"), tok)


def test_text_and_arithmetic_examples_train_every_token(tmp_path, tok):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "héllo <|im_end|>"}])
    (example,) = text_examples(path, tok)
    assert example.input_ids == [BOS] + list("héllo ".encode()) + [IM_END, EOS]
    assert example.labels == example.input_ids
    docs = arithmetic_documents(3, seed=5, operation="-")
    for doc, ex in zip(docs, arithmetic_examples(3, seed=5, operation="-", tokenizer=tok)):
        a, b, c = map(int, re.fullmatch(r"Q: (\d+) - (\d+) = \? A: (-?\d+)\.", doc).groups())
        assert a - b == c
        assert ex.input_ids == [BOS] + list(doc.encode()) + [EOS] and ex.labels == ex.input_ids


def test_datasets_formats_match_jsonl(tmp_path, tok):
    import datasets

    records = [chat(1), {"messages": TWO_TURNS[:3]}, chat(2)]
    want = sft_examples(write_jsonl(tmp_path / "chats.jsonl", records), tok)
    json_path = tmp_path / "chats.json"
    json_path.write_text(json.dumps(records))
    assert sft_examples(str(json_path), tok) == want
    # one column type for all rows: datasets turns the string "2." into 2.0 next to a list content
    json_path.write_text(json.dumps(records + [{"messages": TWO_TURNS}]))
    with pytest.raises(
        ValueError, match=re.escape(f"data.path: row 1 of {json_path}: messages[1].content must be a string")
    ) as err:
        sft_examples(str(json_path), tok)
    assert "same content form (all strings or all lists)" in str(err.value)
    parquet_path = str(tmp_path / "docs.parquet")
    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).to_parquet(parquet_path)
    assert [tok.decode(e.input_ids) for e in text_examples(parquet_path, tok)] == [
        "<|bos|>one<|eos|>",
        "<|bos|>two<|eos|>",
    ]
    csv_path = tmp_path / "docs.csv"
    csv_path.write_text("text,other\nfine,1\n,2\n")  # the empty cell reads as None
    with pytest.raises(ValueError, match=re.escape(f"data.path: row 2 of {csv_path}: needs an object")):
        text_examples(str(csv_path), tok)


def ex(n, start):
    """An example of n tokens whose ids (and labels, except the first) count up from start."""
    ids = list(range(start, start + n))
    return Example(ids, [-100] + ids[1:])


def test_first_fit_packing_layout():
    examples = [ex(5, 0), ex(6, 10), ex(3, 20), ex(2, 30), ex(4, 40)]
    rows = pack_examples(examples, seq_len=8)
    # first fit in order: 5 opens row 0, 6 opens row 1, 3 fills row 0, 2 fills row 1, 4 opens row 2
    assert [r.input_ids.tolist() for r in rows] == [
        [0, 1, 2, 3, 4, 20, 21, 22],
        [10, 11, 12, 13, 14, 15, 30, 31],
        [40, 41, 42, 43, PAD, PAD, PAD, PAD],
    ]
    assert [r.labels.tolist() for r in rows] == [
        [-100, 1, 2, 3, 4, -100, 21, 22],
        [-100, 11, 12, 13, 14, 15, -100, 31],
        [-100, 41, 42, 43] + [-100] * 4,
    ]
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 5, 8], [0, 6, 8], [0, 4, 8]]
    unpacked = pack_examples(examples[:2], seq_len=8, pack=False)
    assert [r.cu_seqlens.tolist() for r in unpacked] == [[0, 5, 8], [0, 6, 8]]
    assert unpacked[0].input_ids.tolist() == [0, 1, 2, 3, 4, PAD, PAD, PAD]


def test_long_examples_are_truncated_with_one_warning():
    with pytest.warns(UserWarning, match=r"data\.seq_len: 2 of 3 examples are longer than 8 tokens") as record:
        rows = pack_examples([ex(12, 0), ex(3, 50), ex(9, 100)], seq_len=8)
    assert len(record) == 1
    assert [r.input_ids.tolist() for r in rows] == [list(range(8)), [50, 51, 52] + [PAD] * 5, list(range(100, 108))]
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 8], [0, 3, 8], [0, 8]]


def shifted_count(examples):
    return sum(sum(t != -100 for t in e.labels[1:]) for e in examples)


def mixed_examples(tok):
    return (
        [chat_example(TWO_TURNS, tok)]
        + arithmetic_examples(5, seed=1, operation="-", tokenizer=tok)
        + [chat_example(chat(i)["messages"], tok) for i in (7, 12)]
    )


def test_packed_rows_give_the_loss_of_each_example_alone(tok):
    torch.manual_seed(0)
    model = MoEPluginForCausalLM(preset_config("tiny", attn_res=False)).eval()
    examples = mixed_examples(tok)
    rows = pack_examples(examples, seq_len=96)
    assert len(rows) < len(examples)  # something really was packed together
    total = shifted_count(examples)
    assert sum(label_token_count(r.labels, r.cu_seqlens) for r in rows) == total
    with torch.no_grad():
        alone = sum(
            model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels]), num_items_in_batch=total).loss
            for e in examples
        )
        packed = sum(
            model(
                input_ids=r.input_ids[None], labels=r.labels[None], cu_seqlens=r.cu_seqlens, num_items_in_batch=total
            ).loss
            for r in rows
        )
        (batch,) = eval_batches(rows, micro_batch_size=len(rows))
        one_row = model(
            input_ids=batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens, num_items_in_batch=total
        ).loss
    assert abs(float(packed) - float(alone)) < 1e-5
    assert abs(float(one_row) - float(alone)) < 1e-5


def uniform_loss_count(batch):
    """What causal_lm_loss counts, measured by the loss itself: with uniform logits each scored token adds log V."""
    logits = torch.zeros(1, batch.input_ids.shape[1], 272)
    return round(float(causal_lm_loss(logits, batch.labels, batch.cu_seqlens, num_items_in_batch=1)) / math.log(272))


@pytest.fixture(scope="module")
def rows(tok):
    examples = arithmetic_examples(40, seed=2, operation="*", tokenizer=tok) + mixed_examples(tok)
    return pack_examples(examples, seq_len=96)


def same_batch(a, b):
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "labels", "cu_seqlens"))


def test_step_batches_resume_exactly_and_reshuffle_each_epoch(rows):
    steps_per_epoch = len(rows) // 4
    batches = StepBatches(rows, micro_batch_size=2, accumulation=2, dp_size=1, seed=3)
    seen = [batches.next_step(0) for _ in range(3)]
    state = json.loads(json.dumps(batches.state_dict()))
    after = [batches.next_step(0) for _ in range(steps_per_epoch + 1)]  # crosses an epoch boundary
    resumed = StepBatches(rows, micro_batch_size=2, accumulation=2, dp_size=1, seed=3)
    resumed.load_state_dict(state)
    for (want, want_count), (got, got_count) in zip(after, (resumed.next_step(0) for _ in after)):
        assert want_count == got_count and all(same_batch(w, g) for w, g in zip(want, got))
    first_epoch = [mb.input_ids for step, _ in (seen + after)[:steps_per_epoch] for mb in step]
    second_epoch = [mb.input_ids for step, _ in (seen + after)[steps_per_epoch:] for mb in step]
    first_rows = [tuple(row) for ids in first_epoch for row in ids.view(-1, 96).tolist()]
    assert len(set(first_rows)) == len(first_rows) == 4 * steps_per_epoch  # no row twice in an epoch
    assert not all(torch.equal(a, b) for a, b in zip(first_epoch, second_epoch))  # a fresh shuffle
    with pytest.raises(ValueError, match=r"data state: was saved with \d+ rows but this run has 3"):
        StepBatches(rows[:3], 1, 1, 1, seed=3).load_state_dict(state)


def test_data_parallel_ranks_together_equal_one_process(rows):
    ranks = [StepBatches(rows, micro_batch_size=1, accumulation=2, dp_size=2, seed=9) for _ in range(2)]
    single = StepBatches(rows, micro_batch_size=2, accumulation=2, dp_size=1, seed=9)
    for _ in range(len(rows) // 4 + 2):
        (r0, count0), (r1, count1) = ranks[0].next_step(0), ranks[1].next_step(1)
        one, count = single.next_step(0)
        assert count0 == count1 == count
        assert count == sum(uniform_loss_count(mb) for mb in r0 + r1) == sum(uniform_loss_count(mb) for mb in one)
        for a, b, both in zip(r0, r1, one):
            assert torch.equal(torch.cat([a.input_ids, b.input_ids], 1), both.input_ids)
            assert torch.equal(torch.cat([a.labels, b.labels], 1), both.labels)
            assert torch.equal(torch.cat([a.cu_seqlens, b.cu_seqlens[1:] + a.input_ids.shape[1]]), both.cu_seqlens)


def test_step_batches_reject_too_few_rows_and_bad_rank(rows):
    with pytest.raises(ValueError, match=r"train\.micro_batch_size: a step takes .* = 8 rows but the data has only 3"):
        StepBatches(rows[:3], micro_batch_size=2, accumulation=2, dp_size=2, seed=0)
    with pytest.raises(ValueError, match=r"dp_rank: must be in \[0, 2\), got 2"):
        StepBatches(rows, 1, 1, 2, seed=0).next_step(2)


def test_eval_batches_are_fixed_and_in_order(rows):
    batches = eval_batches(rows[:5], micro_batch_size=2)
    assert [b.input_ids.shape[1] for b in batches] == [192, 192, 96]
    assert torch.equal(batches[1].input_ids[0, :96], rows[2].input_ids)
    assert len(eval_batches(rows, micro_batch_size=2, count=2)) == 2
    assert all(same_batch(a, b) for a, b in zip(eval_batches(rows, 2, 2), batches))


def section(**fields):
    base = dict(kind="sft", path=None, operation="+", num_documents=0, seq_len=64, eval_fraction=0.25, pack=True)
    return SimpleNamespace(**(base | fields))


def test_held_out_split_is_stable_when_unrelated_lines_are_added(tmp_path, tok):
    originals = [chat(i) for i in range(60)]
    train, held = load_examples(section(path=write_jsonl(tmp_path / "a.jsonl", originals)), seed=0, tokenizer=tok)
    assert 5 <= len(held) <= 25 and len(train) + len(held) == 60
    grown = originals + [chat(i) for i in range(100, 160)]
    random.Random(1).shuffle(grown)
    train2, held2 = load_examples(section(path=write_jsonl(tmp_path / "b.jsonl", grown)), seed=0, tokenizer=tok)
    key = lambda e: tuple(e.input_ids)  # noqa: E731
    originals_keys = {key(e) for e in train + held}
    assert {key(e) for e in held2} & originals_keys == {key(e) for e in held}
    assert {key(e) for e in train2} & originals_keys == {key(e) for e in train}


def test_arithmetic_split_holds_out_about_the_fraction(tok):
    train, held = load_examples(
        section(kind="arithmetic", num_documents=2000, eval_fraction=0.1), seed=4, tokenizer=tok
    )
    assert 150 <= len(held) <= 250 and len(train) + len(held) == 2000
    assert not {tuple(e.input_ids) for e in held} & {tuple(e.input_ids) for e in train}


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(kind="images"), r"data\.kind: must be 'arithmetic', 'sft' or 'text', got 'images'"),
        (dict(kind="text", path=None), r"data\.path: is required when data\.kind is 'text'"),
        (dict(kind="arithmetic", num_documents=10, eval_fraction=0.7), r"data\.eval_fraction: must be a number in"),
        (dict(kind="arithmetic", num_documents=1, eval_fraction=0.01), r"data\.eval_fraction: .* selects none"),
        (
            dict(kind="arithmetic", num_documents=0),
            r"data\.num_documents: must be positive to generate examples, got 0",
        ),
    ],
)
def test_load_examples_errors_name_the_field(tok, fields, match):
    with pytest.raises(ValueError, match=match):
        load_examples(section(**fields), seed=0, tokenizer=tok)
