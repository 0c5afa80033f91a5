"""The base's own tokenizer, loaded from its directory, and the chat tokens the trainer needs from it.

``load_base_tokenizer(path)`` is ``AutoTokenizer.from_pretrained`` on local files only, after two refusals
made without running anything from the directory: no tokenizer files, and remote code (an ``auto_map``)
without ``model.trust_remote_code``. ``chat_tokens(tokenizer)`` reads the end-of-turn tokens from the ids of the
tokenizer's own chat format (``render_ids``: a Jinja template, or a tokenizer's own Python ``apply_chat_template``
such as K3's, whose ``chat_template`` is None), and the eos, pad and image placeholder tokens from the tokenizer,
config.json and generation_config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

# Any one of these makes a directory a tokenizer's (transformers' own names, K2's tiktoken.model included);
# a directory with none would get a tokenizer built from nothing (the byte tokenizer, for this model type).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# The files whose `auto_map` AutoTokenizer (and AutoConfig, which it calls) or AutoProcessor follow into code
REMOTE_CODE_FILES = ("tokenizer_config.json", "config.json", "processor_config.json", "preprocessor_config.json")
IMAGE_TOKEN_KEYS = ("image_token_id", "media_placeholder_token_id", "image_token_index")

_FIELD = "model.from_pretrained"
_PROBE_QUESTION = "What is 6 times 7?"
# two answers ending in different tokens: what follows both alike is the end of the turn
_PROBE_ANSWERS = ("The answer is 42.", "Forty-two, I think")


def read_json(path: str, field: str = _FIELD) -> Optional[dict]:
    """The JSON object in ``path``, or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{field}: {path} is not readable JSON ({type(e).__name__}: {str(e).splitlines()[0]}); "
            f"restore the file from the base's original copy"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{field}: {path} must hold a JSON object, got {type(data).__name__}; restore the file "
            f"from the base's original copy"
        )
    return data


def check_remote_code(path: str, trust_remote_code: bool, files=REMOTE_CODE_FILES) -> None:
    """Raise a ValueError naming ``model.trust_remote_code`` when one of ``files`` in ``path`` has an
    ``auto_map`` (code shipped in the directory) and ``trust_remote_code`` is false. Reads JSON only."""
    if trust_remote_code:
        return
    for name in files:
        config = read_json(os.path.join(path, name))
        if config and config.get("auto_map"):
            auto_map = config["auto_map"]
            refs = sorted(
                {
                    str(r)
                    for r in (auto_map.values() if isinstance(auto_map, dict) else auto_map)
                    for r in (r if isinstance(r, (list, tuple)) else [r])
                    if r
                }
            )
            raise ValueError(
                f"model.trust_remote_code: {os.path.join(path, name)} maps to code shipped in the "
                f"directory ({', '.join(refs)}), which runs only if you trust it; set "
                f"model.trust_remote_code to true to run it as transformers does"
            )


def load_base_tokenizer(path: str, *, trust_remote_code: bool = False, field: str = _FIELD):
    """The tokenizer saved in the local directory ``path``, as ``AutoTokenizer.from_pretrained`` loads it.

    Refused before transformers runs: ``path`` not a directory (hub names are not fetched), no tokenizer
    file in it, or an ``auto_map`` in its configs without ``trust_remote_code``. A tokenizer that
    transformers cannot load is a ValueError naming ``field`` and ``path``.
    """
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(
            f"{field}: {path!r} is not a directory; give a local directory holding the base's "
            f"config.json and tokenizer (hub names are not downloaded)"
        )
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(
            f"{field}: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            f"base's tokenizer files into it, or use model.preset for the built-in byte tokenizer"
        )
    check_remote_code(path, trust_remote_code)
    from transformers import AutoTokenizer  # imported late: slow to import; the package registers its tokenizer

    declared = (read_json(os.path.join(path, "tokenizer_config.json"), field) or {}).get("tokenizer_class")
    try:
        if declared == "ByteTokenizer":
            # this package's own class, named by its saved config: AutoTokenizer finds it only through the
            # model_type registration, which a base of another model_type (a packed K3/K2 layout, say) lacks
            from .tokenizer import ByteTokenizer

            return ByteTokenizer.from_pretrained(path, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises many types for a broken tokenizer; all are bad input here
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{field}: the tokenizer in {path} does not load ({type(e).__name__}: {first}); "
            f"restore its tokenizer files from the base's original copy"
        ) from e


@dataclass(frozen=True)
class ChatTokens:
    """What the trainer and generation need from a base's tokenizer.

    ``end_of_turn``: the ids the chat format writes after an assistant's content, through the last special
    token among them (``<|im_end|>``; K3's ``<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>``; a
    newline after it is not part of it). ``eos_ids``: the tokenizer's eos, config.json's and
    generation_config.json's ``eos_token_id`` (int or list). ``pad_id``: the pad token, else config.json's
    ``pad_token_id``, else the first eos. ``image_token``/``image_token_id``: the image placeholder, None for
    a text-only base. ``image_prompts``: the chat format writes an image only from the ``image_prompts`` it is
    given (K3's tokenizer, ``k3_image_prompt``), not from the content part alone.
    """

    end_of_turn: Tuple[int, ...]
    eos_ids: Tuple[int, ...]
    pad_id: int
    padding_side: str
    image_token: Optional[str] = None
    image_token_id: Optional[int] = None
    image_prompts: bool = False

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        """The ids at which generation of an answer stops: the eos ids and the turn's last end-of-turn id."""
        return tuple(dict.fromkeys(self.eos_ids + self.end_of_turn[-1:]))


def special_ids(tokenizer) -> set:
    """Every special id: the named special tokens and each added token marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
    return ids


def k3_image_prompt(width: int, height: int) -> str:
    """What K3's processor writes for one image of ``width`` x ``height`` pixels (its original size), handed to
    the tokenizer as ``image_prompts`` (docs/k3-formats.md, "Images")."""
    return f"<|media_begin|>image {int(width)}x{int(height)}<|media_content|><|media_pad|><|media_end|>"


def ids_of(rendered) -> List[int]:
    """The token ids of one conversation from what ``apply_chat_template(tokenize=True)`` returned: a flat list,
    a batch of one (list of lists, a ``[1, T]`` tensor) or a dict/``BatchEncoding`` holding either."""
    if hasattr(rendered, "keys") and "input_ids" in rendered.keys():
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    if isinstance(rendered, (list, tuple)) and rendered and isinstance(rendered[0], (list, tuple)):
        if len(rendered) != 1:
            raise ValueError(f"the chat template returned {len(rendered)} rows for one conversation")
        rendered = rendered[0]
    if not isinstance(rendered, (list, tuple)) or not all(isinstance(t, int) for t in rendered):
        raise ValueError(f"the chat template returned {type(rendered).__name__}, not token ids")
    return [int(t) for t in rendered]


def render_ids(tokenizer, messages: List[dict], add_generation_prompt: bool, **kwargs) -> List[int]:
    """The ids of ``messages`` as the tokenizer's own chat format writes them: its ``apply_chat_template`` (a
    Jinja template or the tokenizer's own Python) with tokenize and the generation prompt always stated, never
    the tokenizer's defaults, and ``kwargs`` (tools, template switches, image_prompts) passed through."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True, **kwargs
    )
    return ids_of(out)


def _common_suffix(a: List[int], b: List[int]) -> List[int]:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n :]


def find_end_of_turn(tokenizer, field: str = _FIELD, template_kwargs: Optional[dict] = None) -> Tuple[int, ...]:
    """The ids the chat format writes after an assistant's content, through the last special token: what two
    one-turn conversations with different answers, rendered to ids, end with alike after their common prompt
    (the prompt with the generation prompt must be a prefix of both)."""
    kwargs = dict(template_kwargs or {})
    user = {"role": "user", "content": _PROBE_QUESTION}
    try:
        prompt = render_ids(tokenizer, [user], True, **kwargs)
        wholes = [
            render_ids(tokenizer, [user, {"role": "assistant", "content": answer}], False, **kwargs)
            for answer in _PROBE_ANSWERS
        ]
    except Exception as e:  # a template's raise_exception, a Jinja error, no template at all: the base's
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{field}: the base's tokenizer has no chat template and its apply_chat_template does not "
                f"render chats without one ({type(e).__name__}); add chat_template.jinja (or chat_template "
                f"in tokenizer_config.json) to the base directory"
            ) from e
        raise ValueError(
            f"{field}: the base's chat format fails on a user and an assistant turn "
            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); give the base a chat template "
            f"(chat_template.jinja) or a tokenizer whose apply_chat_template renders chats"
        ) from e
    if not all(whole[: len(prompt)] == prompt and len(whole) > len(prompt) for whole in wholes):
        raise ValueError(
            f"{field}: the chat template does not render the prompt with the generation prompt as "
            f"a prefix of the conversation with the answer, so turns cannot be located; use a "
            f"template whose prompts render as prefixes"
        )
    after = _common_suffix(wholes[0][len(prompt) :], wholes[1][len(prompt) :])
    special = special_ids(tokenizer)
    last = max((i for i, t in enumerate(after) if t in special), default=-1)
    if last < 0:
        raise ValueError(
            f"{field}: the chat template writes no special token after an assistant's answer "
            f"({tokenizer.decode(after)!r}), so the model could not learn where a turn ends; "
            f"use a template that closes each turn with a special token such as the eos token"
        )
    return tuple(after[: last + 1])


def _config_image_token(tokenizer, config_dict: dict) -> Optional[int]:
    for key in IMAGE_TOKEN_KEYS:
        value = config_dict.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tokenizer):
            raise ValueError(
                f"config.json: {key} must be a token id below the tokenizer's {len(tokenizer)} "
                f"tokens, got {value!r}; set it to the id of the image placeholder token"
            )
        return value
    return None


def _needs_image_prompts(tokenizer, image_id: int, kwargs: dict) -> bool:
    """Whether the chat format writes the image token only when handed ``image_prompts`` (K3's tokenizer)."""
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _PROBE_QUESTION}]}]
    try:
        if image_id in render_ids(tokenizer, chat, True, **kwargs):
            return False
        return render_ids(tokenizer, chat, True, image_prompts=[k3_image_prompt(28, 28)], **kwargs).count(image_id) == 1
    except Exception:  # a template that refuses image parts or image_prompts writes images its own way, or never
        return False


def _eos_list(value) -> List:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def chat_tokens(
    tokenizer,
    config_dict: Optional[dict] = None,
    processor=None,
    *,
    generation_config: Optional[dict] = None,
    template_kwargs: Optional[dict] = None,
    field: str = _FIELD,
) -> ChatTokens:
    """The base's ``ChatTokens``: from ``tokenizer`` (its chat format included, rendered with
    ``template_kwargs``), its ``config.json`` and ``generation_config.json`` as dicts, and its processor where
    it has one (for ``image_token``)."""
    config_dict = config_dict or {}
    end_of_turn = find_end_of_turn(tokenizer, field, template_kwargs)
    eos = [tokenizer.eos_token_id] + _eos_list(config_dict.get("eos_token_id"))
    eos += _eos_list((generation_config or {}).get("eos_token_id"))
    eos_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
    pad_id = next(
        (int(i) for i in (tokenizer.pad_token_id, config_dict.get("pad_token_id")) if i is not None),
        eos_ids[0] if eos_ids else None,
    )
    if pad_id is None:
        raise ValueError(
            f"{field}: the base's tokenizer has neither a pad nor an eos token; set pad_token in "
            f"its tokenizer_config.json"
        )
    image_id = _config_image_token(tokenizer, config_dict)
    if image_id is None:
        # the processor's token first (it is what expands the placeholder), then a multimodal tokenizer's own
        for owner in (processor, tokenizer):
            token = getattr(owner, "image_token", None) if owner is not None else None
            if isinstance(token, str) and token in tokenizer.get_vocab():
                image_id = tokenizer.convert_tokens_to_ids(token)
                break
    image_token = tokenizer.convert_ids_to_tokens(image_id) if image_id is not None else None
    prompts = image_id is not None and _needs_image_prompts(tokenizer, image_id, dict(template_kwargs or {}))
    return ChatTokens(end_of_turn, eos_ids, pad_id, tokenizer.padding_side, image_token, image_id, prompts)
