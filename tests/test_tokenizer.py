"""Tokenizer: GGUF and HF-directory tokenizers vs transformers, chat templates, streaming detokenization."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from specwire.default_model import default_model_path
from specwire.errors import ModelLoadError
from specwire.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " 12345 and 3.14159, 1,000,000 or 2024-11-22T13:45:00Z",
    "  leading spaces\n\n\ttabs   and trailing  ",
    "héllo wörld ünïcödé — “quotes” …",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🎉 family 👨‍👩‍👧 flag 🇫🇷 done",
    "def f(x):\n    return x**2  # comment\n\nclass A:\n\tpass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "it's we're they'll I'd DON'T",
    "a\r\nb\rc\n\n\n\nd",
    "    \n  \n",
    "https://example.com/path?q=1&x=%20#frag",
    "Ωmega ∑ ∫ √2 ≈ 1.414",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with émoji 🎨?"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_digits_are_split_one_by_one(ours: Tokenizer) -> None:
    # SmolLM2's tokenizer (llama.cpp pre-tokenizer "smollm") never merges digits.
    ids = ours.encode("year 20241122")
    pieces = [ours.decode([i]) for i in ids]
    assert pieces[-8:] == list("20241122")


def test_decode_random_ids_matches_transformers(ours: Tokenizer, hf_tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            expected = hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected


def test_special_ids_and_vocab(ours: Tokenizer, hf_tokenizer) -> None:
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert ours.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert ours.eos_token_ids == (hf_tokenizer.eos_token_id,) == (2,)
    assert (
        len(ours.fingerprint) == 64 and ours.fingerprint == load_tokenizer(default_model_path()).fingerprint
    )


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf_tokenizer, messages, add_generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_hf_directory_tokenizer_equals_gguf_one(ours: Tokenizer, hf_tokenizer, tmp_path: Path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    hf = load_tokenizer(tmp_path)
    assert hf.fingerprint == ours.fingerprint
    assert (hf.bos_token_id, hf.eos_token_ids, hf.vocab_size) == (1, (2,), 49152)
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text)
    for messages in CHATS:
        assert hf.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_chat_template_errors_are_value_errors(ours: Tokenizer) -> None:
    raising = Tokenizer(
        ours.backend,
        bos_token_id=None,
        eos_token_ids=(),
        chat_template="{{ raise_exception('roles must alternate') }}",
        special_tokens={},
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        raising.apply_chat_template(CHATS[0])
    bare = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=(), chat_template=None, special_tokens={})
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])


def test_chat_template_is_sandboxed(ours: Tokenizer) -> None:
    evil = Tokenizer(
        ours.backend,
        bos_token_id=None,
        eos_token_ids=(),
        chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}",
        special_tokens={},
    )
    with pytest.raises(Exception, match="unsafe|access"):
        evil.apply_chat_template(CHATS[0])


# ---- streaming ----


def stream(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), seed: int = 0):
    """Feed ids in random-sized chunks; return (emitted pieces, detokenizer)."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(detok.push(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_detokenizer_equals_full_decode(ours: Tokenizer, seed: int) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        pieces, detok = stream(ours, ids, seed=seed)
        assert "".join(pieces) == ours.decode(ids) == detok.text
        assert not any("\ufffd" in piece for piece in pieces)  # never half a UTF-8 character
        assert not detok.stopped


def test_emoji_split_over_tokens_waits_for_all_bytes(ours: Tokenizer) -> None:
    ids = ours.encode("🤖")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(ours)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🤖"


def test_stop_string_spanning_tokens(ours: Tokenizer) -> None:
    text = "The answer is: STOP here, and more text."
    ids = ours.encode(text)
    for stop in (("is: ST",), ("nothing", "STOP"), ("STOP", "answer")):
        pieces, detok = stream(ours, ids, stop)
        first = min(text.index(s) for s in stop if s in text)
        assert detok.stopped
        assert "".join(pieces) == detok.text == text[:first]
        assert detok.push(ours.encode(" later")) == "" and detok.flush() == ""


def test_text_that_may_start_a_stop_string_is_held_back(ours: Tokenizer) -> None:
    detok = IncrementalDetokenizer(ours, stop=("<END>",))
    out = detok.push(ours.encode("value <EN"))
    assert out == "value " and not detok.stopped  # "<EN" could still become "<END>"
    assert detok.push(ours.encode("D> tail")) == "" and detok.stopped and detok.text == "value "

    detok = IncrementalDetokenizer(ours, stop=("<END>",))
    assert detok.push(ours.encode("value <EN")) == "value "
    assert detok.push(ours.encode("ough")) == "<ENough"  # it did not: release it
    assert detok.push(ours.encode(" <")) == " "
    assert detok.flush() == "<"  # end of stream: nothing is held back


def test_stop_at_the_very_start(ours: Tokenizer) -> None:
    pieces, detok = stream(ours, ours.encode("Stop right away"), stop=("Stop",))
    assert detok.stopped and "".join(pieces) == "" and detok.text == ""


def test_empty_stop_string_is_rejected(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(ours, stop=("",))


# ---- errors ----


def write_tokenizer_gguf(path: Path, model: str, pre: str) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", "gpt-2"))
    assert tok.encode("abba") == [2, 1, 0]
    assert tok.vocab_size == 3 and tok.chat_template is None


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'llama'"):
        load_tokenizer(write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", "default"))
    with pytest.raises(ModelLoadError, match="unsupported GGUF pre-tokenizer 'mystery'"):
        load_tokenizer(write_tokenizer_gguf(tmp_path / "pre.gguf", "gpt2", "mystery"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="bad magic"):
        load_tokenizer(bad)
