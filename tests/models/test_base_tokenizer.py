import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_plugin.models.base_tokenizer import chat_tokens, load_base_tokenizer
from moe_plugin.models.subword_tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, build_subword_tokenizer
from moe_plugin.models.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
BYTE_BASE, SUBWORD_BASE = REPO / "recipes/bases/tiny-arith", REPO / "recipes/bases/tiny-subword"
REMOTE = REPO / "tests/fixtures/remote_tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def subword():
    return load_base_tokenizer(str(SUBWORD_BASE))


def copy_subword(directory: Path, **config) -> Path:
    directory.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(SUBWORD_BASE / name, directory / name)
    if config:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_byte_base_loads_its_byte_tokenizer_and_chat_tokens():
    tok = load_base_tokenizer(str(BYTE_BASE))
    assert isinstance(tok, ByteTokenizer)
    tokens = chat_tokens(tok, json.loads((BYTE_BASE / "config.json").read_text()))
    assert tok.convert_ids_to_tokens(list(tokens.end_of_turn)) == ["<|im_end|>"]  # the newline after it is not
    assert (tokens.eos_ids, tokens.pad_id, tokens.padding_side) == ((258,), 256, "right")
    assert (tokens.image_token, tokens.image_token_id) == ("<|image|>", 259)
    assert tokens.stop_ids == (258, 261)


def test_subword_base_is_a_real_subword_tokenizer_under_256_ids(subword):
    assert not isinstance(subword, ByteTokenizer)
    assert len(subword) == subword.vocab_size == VOCAB_SIZE < 256
    assert [subword.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = "What color is the background?"
    ids = subword.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode()) / 2  # merged pieces, not characters
    assert subword.decode(ids) == text


def test_subword_chat_tokens(subword):
    tokens = chat_tokens(subword)
    assert subword.convert_ids_to_tokens(list(tokens.end_of_turn)) == ["<|im_end|>"]
    assert tokens.eos_ids == (subword.convert_tokens_to_ids("[EOS]"),)
    assert tokens.pad_id == subword.convert_tokens_to_ids("[PAD]")
    # no config.json yet: the placeholder is the tokenizer's own named image token
    media_pad = subword.convert_tokens_to_ids("<|media_pad|>")
    assert (tokens.image_token, tokens.image_token_id) == ("<|media_pad|>", media_pad)
    # config.json's id wins over the tokenizer's, and its eos ids join the tokenizer's
    from_config = chat_tokens(subword, {"media_placeholder_token_id": 9, "eos_token_id": [2, 8]})
    assert (from_config.image_token, from_config.image_token_id) == ("<|media_start|>", 9)
    assert from_config.eos_ids == (2, 8) and from_config.stop_ids == (2, 8)


def test_config_image_token_out_of_range_is_refused(subword):
    with pytest.raises(
        ValueError,
        match=r"^config.json: image_token_id must be a token id below the tokenizer's "
        r"240 tokens, got 259",
    ):
        chat_tokens(subword, {"image_token_id": 259})  # the byte base's id does not fit this vocabulary


def test_task_texts_encode_without_unknown_tokens(subword):
    from moe_plugin.training.data.pipeline import arithmetic_documents
    from examples.shape_tasks import QUESTION_OF
    from examples.shapes import COLORS, SHAPES

    texts = list(QUESTION_OF.values()) + sorted(COLORS) + list(SHAPES) + arithmetic_documents(50, 0, "-")
    for text in texts:
        ids = subword.encode(text, add_special_tokens=False)
        assert subword.unk_token_id not in ids, text
        assert max(ids) < len(subword) and subword.decode(ids) == text


def test_build_is_deterministic_and_the_shipped_copy_is_current(tmp_path):
    build_subword_tokenizer(str(tmp_path / "a"))
    build_subword_tokenizer(str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path / "a")) == sorted(TOKENIZER_FILES)
    for name in TOKENIZER_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (tmp_path / "a" / name).read_bytes() == (SUBWORD_BASE / name).read_bytes(), name


def test_directory_without_tokenizer_is_refused(tmp_path):
    # a config.json alone would get this model type's byte tokenizer from AutoTokenizer, silently
    shutil.copy(BYTE_BASE / "config.json", tmp_path / "config.json")
    with pytest.raises(
        ValueError,
        match=r"^model.from_pretrained: .* holds no tokenizer \(none of "
        r"tokenizer_config.json, .*\); copy the base's tokenizer files",
    ):
        load_base_tokenizer(str(tmp_path))


@pytest.mark.parametrize("path", ["moonshotai/Kimi-K2-Instruct", "no/such/dir"])
def test_non_directory_is_refused(path):
    with pytest.raises(ValueError, match=r"^model.from_pretrained: .* is not a directory; .*not downloaded"):
        load_base_tokenizer(path)


def test_broken_tokenizer_files_are_refused_naming_the_path(tmp_path):
    base = copy_subword(tmp_path / "base")
    (base / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"^model.from_pretrained: the tokenizer in .*base does not load "):
        load_base_tokenizer(str(base))
    (base / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^model.from_pretrained: .*tokenizer_config.json is not readable JSON"):
        load_base_tokenizer(str(base))


def test_auto_map_in_config_json_is_refused_without_trust(tmp_path):
    base = copy_subword(tmp_path / "base", model_type="kimi_k3", auto_map={"AutoConfig": "configuration_k3.K3Config"})
    with pytest.raises(
        ValueError,
        match=r"^model.trust_remote_code: .*config.json maps to code shipped in the "
        r"directory \(configuration_k3.K3Config\).*set model.trust_remote_code",
    ):
        load_base_tokenizer(str(base))


_REMOTE_CHECK = """
import json, os, sys
from moe_plugin.models.base_tokenizer import load_base_tokenizer
path, cache = sys.argv[1], os.environ["HF_MODULES_CACHE"]
def imported():
    return sorted(n for n in sys.modules if n.endswith("tokenization_tiny"))
def copied():
    return sorted(f for _, _, fs in os.walk(cache) for f in fs if f == "tokenization_tiny.py")
try:
    load_base_tokenizer(path)
    refused = None
except ValueError as e:
    refused = str(e)
result = {"refused": refused, "imported_before": imported(), "copied_before": copied()}
tok = load_base_tokenizer(path, trust_remote_code=True)
result.update(cls=type(tok).__name__, imported_after=imported(), ids=tok.encode("abc 1", add_special_tokens=False))
print(json.dumps(result))
"""


@pytest.mark.distributed
def test_remote_code_tokenizer_refused_without_trust_and_loaded_with_it(tmp_path):
    # a fresh process, so that no earlier import of the fixture's module can hide one made here
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", _REMOTE_CHECK, str(REMOTE)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["refused"].startswith(
        f"model.trust_remote_code: {REMOTE}/tokenizer_config.json maps to code "
        f"shipped in the directory (tokenization_tiny.TinyRemoteTokenizer)"
    )
    assert "\n" not in result["refused"]
    assert result["imported_before"] == [] and result["copied_before"] == []
    assert result["cls"] == "TinyRemoteTokenizer" and len(result["imported_after"]) == 1
    assert result["ids"] == [0, 1, 2, 36, 27]  # the fixture's own alphabet: a b c space 1
