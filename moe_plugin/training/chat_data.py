"""Chat (SFT) data: ``{"messages": [{"role", "content"}, ...]}`` records rendered with the chat template, loss
only on the assistant turns; images in the content (docs/multimodal.md 2, ``image_data``) are expanded to
their merged tokens, never trained, and travel with the example."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from ..config import require
from .image_data import IMAGE_PLACEHOLDER, Images, expand_placeholders, image_sources, inline_source, load_images, \
    record_has_images
from .records import IGNORE, Example, default_tokenizer, describe, encode, read_records

_ROLES = ("system", "user", "assistant")


def _checked_messages(where: str, record) -> Tuple[List[dict], List[str]]:
    """The record's messages, each ``{"role", "content"}`` with content a string or a list of text/image
    items, and the sources of its inline image items in order (``image_data``)."""
    require(isinstance(record, dict), "data.path",
            f"{where}: must be a JSON object with a 'messages' list, got {describe(record)}")
    messages = record.get("messages")
    require(isinstance(messages, list) and len(messages) > 0, "data.path",
            f"{where}: needs a non-empty 'messages' list, got {describe(messages)}")
    checked, inline = [], []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        require(isinstance(message, dict) and "role" in message and "content" in message, "data.path",
                f"{at} needs both 'role' and 'content', got {describe(message)}")
        role, content = message["role"], message["content"]
        require(role in _ROLES, "data.path", f"{at}.role must be one of {list(_ROLES)}, got {role!r}")
        if isinstance(content, list):
            items = []
            for j, item in enumerate(content):
                kind = item.get("type") if isinstance(item, dict) else None
                if kind == "image":
                    source = inline_source(f"{at}.content[{j}]", item)
                    inline += [source] if source is not None else []
                    items.append({"type": "image"})
                    continue
                require(kind == "text" and isinstance(item.get("text"), str), "data.path",
                        f"{at}.content[{j}] must be {{\"type\": \"text\", \"text\": <string>}} or "
                        f"{{\"type\": \"image\", \"image\": <path or data URL>}}, got {describe(item)}")
                items.append({"type": "text", "text": item["text"]})
            content = items
        else:
            # datasets infers one column type for all rows and may coerce mixed contents (e.g. "2." to 2.0)
            hint = ("; a file read through datasets needs the same content form (all strings or all lists) "
                    "in every message, .jsonl has no such limit") if where.startswith("row ") else ""
            require(isinstance(content, str), "data.path",
                    f"{at}.content must be a string or a list of {{\"type\": \"text\", ...}} items, "
                    f"got {describe(content)}{hint}")
        require(role != "assistant" or not _is_empty(content), "data.path",
                f"{at} is an assistant turn with empty content, so it would teach only to end at once; write "
                "the answer or remove the turn")
        checked.append({"role": role, "content": content})
    require(any(m["role"] == "assistant" for m in checked), "data.path",
            f"{where}: has no assistant turn, so nothing would be trained; add an assistant message")
    return checked, inline


def _is_empty(content) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return all(item["type"] == "text" and not item["text"].strip() for item in content)


def _render(tokenizer, messages: List[dict], add_generation_prompt: bool = False, tokens_per_image=()) -> List[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return encode(tokenizer, expand_placeholders(text, tokens_per_image))


def chat_example(messages: List[dict], tokenizer=None, where: str = "messages", images: Optional[Images] = None,
                 merge_size: int = 2) -> Example:
    """The chat rendered with the tokenizer's template, loss only on each assistant turn's content and its
    closing ``<|im_end|>``. With ``images`` (one per ``<|image|>`` of the rendering, in order; a different
    count raises a ValueError), each placeholder becomes its image's ``h * w / merge_size**2`` placeholder
    tokens, which are never trained.

    The spans come from rendering prefixes of the conversation: turn i's content starts after the rendering
    of ``messages[:i]`` with the generation prompt and ends with the rendering of ``messages[:i+1]``, less
    what the template writes after ``<|im_end|>``. A template whose prefixes do not render as prefixes of
    the whole conversation cannot be masked this way and raises a ValueError.
    """
    tokenizer = default_tokenizer(tokenizer)
    placeholders = tokenizer.apply_chat_template(messages, tokenize=False).count(IMAGE_PLACEHOLDER)
    num_images = 0 if images is None else int(images.grid_hw.shape[0])
    require(placeholders == num_images, "data.path",
            f"{where}: the conversation holds {placeholders} {IMAGE_PLACEHOLDER} placeholders but {num_images} "
            f"images; give exactly one image per placeholder")
    counts = images.tokens_per_image(merge_size) if images is not None else []
    ids = _render(tokenizer, messages, tokens_per_image=counts)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, tokens_per_image=counts)
        through = _render(tokenizer, messages[:i + 1], tokens_per_image=counts)
        require(ids[:len(before)] == before and ids[:len(through)] == through, "data.path",
                f"{where}: the chat template does not render a prefix of the conversation as a prefix of the "
                f"whole, so the assistant turns cannot be located; use a ChatML-like template")
        span = through[len(before):]
        # the turn ends at its last <|im_end|>; the newline the template writes after it is not trained
        end = len(before) + (len(span) - span[::-1].index(im_end) if im_end in span else len(span))
        labels[len(before):end] = ids[len(before):end]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    labels = [IGNORE if t == image_id else label for t, label in zip(ids, labels)]  # an image is input only
    return Example(ids, labels, images, where)


def sft_examples(path: str, tokenizer=None, processor=None) -> List[Example]:
    """One ``{"messages": [{"role", "content"}, ...]}`` conversation per record, loss only on assistant turns;
    images (``image_data``) through ``processor`` (default: a ``MoEProcessor`` around ``tokenizer``)."""
    tokenizer = default_tokenizer(tokenizer)
    base_dir, examples = os.path.dirname(os.path.abspath(path)), []
    for where, record in read_records(path):
        messages, inline = _checked_messages(where, record)
        sources = image_sources(where, record, inline)
        if sources and processor is None:
            from ..models.processing import MoEProcessor  # imported late: transformers is slow to import
            processor = MoEProcessor(tokenizer=tokenizer)
        images = load_images(where, sources, base_dir, processor.image_processor) if sources else None
        merge = processor.image_processor.merge_size if processor is not None else 2
        examples.append(chat_example(messages, tokenizer, where, images, merge))
    return examples


def has_images(section) -> bool:
    """Whether the recipe's data section (``kind``, ``path``) holds any image, without reading one."""
    return section.kind == "sft" and bool(section.path) and any(
        record_has_images(record) for _, record in read_records(section.path))
