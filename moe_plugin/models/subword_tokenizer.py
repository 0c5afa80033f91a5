"""A tiny real subword (BPE) tokenizer with a Kimi-style chat template, for the second shipped base.

``build_subword_tokenizer(directory)`` trains a BPE with the ``tokenizers`` package on a corpus generated here
(the wording of the arithmetic and colour/shape tasks: digits, colour and shape words, question words), wraps
it in a ``PreTrainedTokenizerFast`` and writes it with ``save_pretrained``. The whole vocabulary, special
tokens included, is ``VOCAB_SIZE`` (< 256) ids, so a byte id passed where a subword id belongs is caught by
an out-of-range id or a wrong decode instead of passing by accident. The same call writes the same bytes.

Rebuild the shipped copy with ``python -m moe_plugin.models.subword_tokenizer recipes/bases/tiny-subword``.

The corpus lists its words itself rather than importing the training tasks (models never import training):
the shipped tokenizer must not drift when a task's wording changes; the tests check the tasks' texts encode
without ``[UNK]``.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator, List

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
)
MEDIA_START, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
)
# ids 0.. in this order; MEDIA_PAD is the image placeholder the processor expands to an image's tokens
SPECIAL_TOKENS = (
    PAD,
    BOS,
    EOS,
    UNK,
    IM_SYSTEM,
    IM_USER,
    IM_ASSISTANT,
    IM_MIDDLE,
    IM_END,
    MEDIA_START,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
)
IMAGE_TOKEN = MEDIA_PAD
# printable ASCII and the newline: any such text encodes without [UNK]
ALPHABET = tuple(chr(c) for c in range(32, 127)) + ("\n",)
VOCAB_SIZE = 240
# GPT-2-like pieces, but one digit a token (as K2-family tokenizers split numbers), so sums are per digit
PRE_TOKENIZE = r" ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]+|\s+"

# Kimi K2's layout: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>, nothing between turns; an image item
# renders as K2-VL's media block around one <|media_pad|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '<|im_system|>system<|im_middle|>' }}"
    "{%- elif message['role'] == 'user' -%}{{ '<|im_user|>user<|im_middle|>' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- else -%}{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|media_start|>image<|media_content|><|media_pad|><|media_end|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- else -%}{{ raise_exception('content items must have type \"text\" or \"image\", got ' + item['type']) }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)

_COLORS = ("red", "green", "blue", "yellow")
_SHAPES = ("square", "circle", "triangle")
_QUESTIONS = (
    "What color is the shape?",
    "What color is the background?",
    "Which shape is this?",
    "What is the answer?",
    "How many sides does the shape have?",
    "Where is the shape?",
)
_WORDS = (
    "system",
    "user",
    "assistant",
    "image",
    "You are a helpful assistant.",
    "Answer with one word.",
    "The answer is",
    "It is",
    "yes",
    "no",
    "plus",
    "minus",
    "equals",
    "and",
    "of",
    "a",
    "an",
    "in",
    "on",
)


def corpus() -> Iterator[str]:
    """The training text, in a fixed order (no randomness: the merges depend only on this code)."""
    for op, fn in (("+", lambda a, b: a + b), ("-", lambda a, b: a - b)):
        for a in range(0, 100, 3):
            for b in range(0, 100, 7):
                yield f"Q: {a} {op} {b} = ? A: {fn(a, b)}."
                yield f"What is {a} {op} {b}? {fn(a, b)}"
    for question in _QUESTIONS:
        for color in _COLORS:
            for shape in _SHAPES:
                yield f"{question} {color.capitalize()}. {color} {shape}. The {shape} is {color}."
                yield f"{color}\n{shape}\nA {color} {shape} on a {color} background."
    for _ in range(20):
        yield " ".join(_WORDS)
        yield "\n".join(_WORDS)
    for _ in range(200):  # the role names follow a special token in every turn: one token each
        yield "system\nuser\nassistant\nimage"


def _train():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # the pieces keep their spaces: joining them restores the text
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(ALPHABET),
        limit_alphabet=len(ALPHABET),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def subword_tokenizer():
    """The trained tokenizer as a ``PreTrainedTokenizerFast`` (not saved)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        # named, so that `tokenizer.image_token` / `image_token_id` give the placeholder as in transformers'
        # multimodal tokenizers
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    for token in SPECIAL_TOKENS:
        if tokenizer.convert_tokens_to_ids(token) != SPECIAL_TOKENS.index(token):
            raise RuntimeError(f"{token} did not get id {SPECIAL_TOKENS.index(token)}; the trainer changed")
    return tokenizer


def build_subword_tokenizer(directory: str) -> List[str]:
    """Train and ``save_pretrained`` the tokenizer into ``directory``; returns the files written."""
    os.makedirs(directory, exist_ok=True)
    return [str(path) for path in subword_tokenizer().save_pretrained(directory)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="train and save the tiny subword tokenizer")
    parser.add_argument("directory", nargs="?", default="recipes/bases/tiny-subword")
    args = parser.parse_args(argv)
    for path in build_subword_tokenizer(args.directory):
        print(path)


if __name__ == "__main__":
    main()
