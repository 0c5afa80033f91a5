"""Chat (SFT) data: ``{"messages": [{"role", "content"}, ...]}`` records rendered with the base's own chat
template (``chat_template``), loss only on the assistant turns; images in the content (docs/multimodal.md 2,
``image_data``) are expanded to their merged tokens, never trained, and travel with the example."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from ...config import require
from .images import Images, image_sources, inline_source, load_images, record_has_images
from .records import Example, default_tokenizer, describe, read_records

_ROLES = ("system", "user", "assistant")


def _checked_messages(where: str, record) -> Tuple[List[dict], List[str]]:
    """The record's messages, each ``{"role", "content"}`` with content a string or a list of text/image
    items, and the sources of its inline image items in order (``image_data``)."""
    require(
        isinstance(record, dict),
        "data.path",
        f"{where}: must be a JSON object with a 'messages' list, got {describe(record)}",
    )
    messages = record.get("messages")
    require(
        isinstance(messages, list) and len(messages) > 0,
        "data.path",
        f"{where}: needs a non-empty 'messages' list, got {describe(messages)}",
    )
    checked, inline = [], []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        require(
            isinstance(message, dict) and "role" in message and "content" in message,
            "data.path",
            f"{at} needs both 'role' and 'content', got {describe(message)}",
        )
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
                require(
                    kind == "text" and isinstance(item.get("text"), str),
                    "data.path",
                    f'{at}.content[{j}] must be {{"type": "text", "text": <string>}} or '
                    f'{{"type": "image", "image": <path or data URL>}}, got {describe(item)}',
                )
                items.append({"type": "text", "text": item["text"]})
            content = items
        else:
            # datasets infers one column type for all rows and may coerce mixed contents (e.g. "2." to 2.0)
            hint = (
                (
                    "; a file read through datasets needs the same content form (all strings or all lists) "
                    "in every message, .jsonl has no such limit"
                )
                if where.startswith("row ")
                else ""
            )
            require(
                isinstance(content, str),
                "data.path",
                f'{at}.content must be a string or a list of {{"type": "text", ...}} items, '
                f"got {describe(content)}{hint}",
            )
        require(
            role != "assistant" or not _is_empty(content),
            "data.path",
            f"{at} is an assistant turn with empty content, so it would teach only to end at once; write "
            "the answer or remove the turn",
        )
        checked.append({"role": role, "content": content})
    require(
        any(m["role"] == "assistant" for m in checked),
        "data.path",
        f"{where}: has no assistant turn, so nothing would be trained; add an assistant message",
    )
    return checked, inline


def _is_empty(content) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return all(item["type"] == "text" and not item["text"].strip() for item in content)


def chat_example(
    messages: List[dict],
    tokenizer=None,
    where: str = "messages",
    images: Optional[Images] = None,
    merge_size: int = 2,
    tokens=None,
) -> Example:
    """The chat rendered by the tokenizer's own chat template (``chat_template.tokenize_chat``): loss only
    on each assistant turn's content and its end-of-turn tokens. With ``images`` (one per image placeholder
    token of the rendering, in order; a different count raises a ValueError), each placeholder becomes its
    image's ``h * w / merge_size**2`` placeholder tokens, which are never trained. ``tokens``: the base's
    ``ChatTokens`` (default: read from ``tokenizer``; pass them when tokenizing many records)."""
    from ...models.base_tokenizer import chat_tokens
    from .chat_template import expand_image_tokens, tokenize_chat

    tokenizer = default_tokenizer(tokenizer)
    tokens = tokens if tokens is not None else chat_tokens(tokenizer)
    ids, labels = tokenize_chat(tokenizer, messages, where=f"data.path: {where}", tokens=tokens)
    num_images = 0 if images is None else int(images.grid_hw.shape[0])
    image_id = tokens.image_token_id
    require(
        image_id is not None or num_images == 0,
        "data.path",
        f"{where}: holds {num_images} images but the base's tokenizer has no image placeholder token; give "
        "a base with a vision tower and an image token (config.json image_token_id), or drop the images",
    )
    if image_id is not None:
        placeholders = sum(1 for t in ids if t == image_id)
        require(
            placeholders == num_images,
            "data.path",
            f"{where}: the conversation holds {placeholders} {tokens.image_token} placeholders but "
            f"{num_images} images; give exactly one image per placeholder",
        )
        counts = images.tokens_per_image(merge_size) if images is not None else []
        ids, labels = expand_image_tokens(ids, labels, image_id, counts, where=f"data.path: {where}")
    return Example(ids, labels, images, where)


def sft_examples(path: str, tokenizer=None, processor=None, tokens=None) -> List[Example]:
    """One ``{"messages": [{"role", "content"}, ...]}`` conversation per record, loss only on assistant turns;
    images (``image_data``) through ``processor`` (default: a ``MoEProcessor`` around ``tokenizer``);
    ``tokens``: the base's ``ChatTokens`` (default: read from ``tokenizer`` once)."""
    from ...models.base_tokenizer import chat_tokens

    tokenizer = default_tokenizer(tokenizer)
    tokens = tokens if tokens is not None else chat_tokens(tokenizer, processor=processor)
    base_dir, examples = os.path.dirname(os.path.abspath(path)), []
    for where, record in read_records(path):
        messages, inline = _checked_messages(where, record)
        sources = image_sources(where, record, inline)
        if sources and processor is None:
            from ...models.processing import MoEProcessor  # imported late: transformers is slow to import

            processor = MoEProcessor(tokenizer=tokenizer)
        images = load_images(where, sources, base_dir, processor.image_processor) if sources else None
        merge = processor.image_processor.merge_size if processor is not None else 2
        examples.append(chat_example(messages, tokenizer, where, images, merge, tokens))
    return examples


def has_images(section) -> bool:
    """Whether the recipe's data section (``kind``, ``path``) holds any image, without reading one."""
    return (
        section.kind == "sft"
        and bool(section.path)
        and any(record_has_images(record) for _, record in read_records(section.path))
    )
