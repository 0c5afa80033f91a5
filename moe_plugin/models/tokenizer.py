"""A byte-level tokenizer that needs no downloaded files, as a transformers ``PreTrainedTokenizer``.

Ids 0..255 are the UTF-8 bytes; ids 256..271 are special tokens at fixed ids (``SPECIAL_TOKENS``), the last
ones reserved so that adding a token later does not move the vocabulary. Any text round-trips exactly:
``decode(encode(text)) == text``. Special tokens written in the text (``<|image|>``, ``<|im_start|>``, ...)
become their single id; everything else is its bytes.

The chat template is ChatML-like: ``<|bos|>`` then per message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``,
where content is a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` items and
each image item becomes one ``<|image|>`` placeholder (the processor expands it to the image's tokens).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from transformers import PreTrainedTokenizer
from transformers.tokenization_python import AddedToken

NUM_BYTES = 256
PAD, BOS, EOS, IMAGE, IM_START, IM_END = ("<|pad|>", "<|bos|>", "<|eos|>", "<|image|>", "<|im_start|>", "<|im_end|>")
NUM_RESERVED = 10
SPECIAL_TOKENS: Tuple[str, ...] = (PAD, BOS, EOS, IMAGE, IM_START, IM_END) + tuple(
    f"<|reserved_{i}|>" for i in range(NUM_RESERVED)
)
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 272

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% else %}{{ raise_exception('content items must have type \"text\" or \"image\", got ' + item['type']) }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ByteTokenizer(PreTrainedTokenizer):
    """UTF-8 bytes plus fixed special tokens; ``vocab_size`` (272) counts both, ``len()`` adds any tokens
    added later with ``add_tokens`` (ids from 272 on)."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        # Fixed ids for the special tokens, set before the base class assigns ids in its own order.
        self._added_tokens_decoder = {
            NUM_BYTES + i: AddedToken(tok, lstrip=False, rstrip=False, normalized=False, special=True)
            for i, tok in enumerate(SPECIAL_TOKENS)
        }
        saved = kwargs.pop("added_tokens_decoder", None) or {}
        # A saved config repeats the fixed table; only tokens added later (ids above it) are taken from it.
        self._added_tokens_decoder.update({int(i): t for i, t in saved.items() if int(i) >= VOCAB_SIZE})
        for name, token in (("pad_token", PAD), ("bos_token", BOS), ("eos_token", EOS)):
            kwargs.setdefault(name, token)
        kwargs.setdefault("extra_special_tokens", [IMAGE, IM_START, IM_END])
        kwargs.setdefault("clean_up_tokenization_spaces", False)  # any cleanup would break the round trip
        kwargs.setdefault("chat_template", CHAT_TEMPLATE)
        kwargs.setdefault("special_tokens_pattern", "none")  # the chat template writes <|bos|> itself
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def image_token(self) -> str:
        return IMAGE

    @property
    def image_token_id(self) -> int:
        return self._added_tokens_encoder[IMAGE]

    def get_vocab(self) -> Dict[str, int]:
        vocab = {chr(b): b for b in range(NUM_BYTES)}
        vocab.update(self._added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        # A byte's token is the character with that code point; only _tokenize produces them.
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> Optional[int]:
        if len(token) == 1 and ord(token) < NUM_BYTES:
            return ord(token)
        return None

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < NUM_BYTES:
            raise ValueError(
                f"token id: {index} is neither a byte (0..255) nor a special token id ({NUM_BYTES}..{VOCAB_SIZE - 1})"
            )
        return chr(index)

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        # Gather byte runs before decoding: one character's UTF-8 bytes are several tokens.
        parts: List[str] = []
        run = bytearray()
        for token in tokens:
            if token in self._added_tokens_encoder:
                parts.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                parts.append(token)
            else:
                run.append(ord(token))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> Tuple[str, ...]:
        return ()  # the vocabulary is fixed by this class; tokenizer_config.json carries the rest
