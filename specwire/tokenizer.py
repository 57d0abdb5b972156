"""Tokenizer: a `tokenizers.Tokenizer` from GGUF metadata or an HF tokenizer.json, plus the chat template.

GGUF files carry no tokenizer.json, only llama.cpp's description of one (tokens, merges, token types and a
pre-tokenizer name). We rebuild the byte-level BPE that name stands for, with llama.cpp's split rules.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from specwire.errors import ModelLoadError
from specwire.gguf_file import GGUFFile

# Pre-tokenizer split rules (llama.cpp's llama-vocab.cpp; the models' tokenizer.json files use the same).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits split one by one first, ignore_merges as llama.cpp sets it)
_GGUF_PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2_SPLIT, False, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (_GPT2_SPLIT, True, False),
    ),
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx", "pixtral"),
        (_LLAMA3_SPLIT, False, True),
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT, False, False)),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        special_tokens: dict[str, str],
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as strings, for the chat template

    @classmethod
    def for_decoding(cls, backend_json: str) -> Tokenizer:
        """A tokenizer that decodes as this one does (`backend.to_str()`), without its chat template or
        special-token names: the verifier's front-end detokenises with it."""
        return cls(Backend.from_str(backend_json), bos_token_id=None, eos_token_ids=(), chat_template=None,
                   special_tokens={})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {' '.join(str(e).split())}") from e

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over (id, token) pairs and BPE merges: equal fingerprints mean the same token ids."""
        digest = hashlib.sha256()
        vocab = self.backend.get_vocab(with_added_tokens=True)
        for token, index in sorted(vocab.items(), key=lambda item: item[1]):
            digest.update(f"{index}\t{token}\n".encode())
        for merge in json.loads(self.backend.to_str())["model"].get("merges") or []:
            digest.update(f"{merge if isinstance(merge, str) else ' '.join(merge)}\n".encode())
        return digest.hexdigest()

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of --chat")
        return _compile_template(self.chat_template)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face directory (tokenizer.json + tokenizer_config.json)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"tokenizer path {str(path)!r} does not exist")
    return _from_hf_dir(path) if path.is_dir() else _from_gguf(GGUFFile.open(path))


# ---- GGUF ----


def _from_gguf(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{gguf.path}: unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2'; "
            "use a Hugging Face directory with tokenizer.json instead)"
        )
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise ModelLoadError(f"{gguf.path}: unsupported GGUF pre-tokenizer {pre!r}")
    split, split_digits, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
    tokens = gguf.require("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in gguf.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}

    backend = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>) and user-defined ones (<think>) are matched whole in the text.
    types = gguf.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{gguf.path}: {len(types)} token types for {len(tokens)} tokens")
    control = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    user_defined = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    ids = {key: gguf.get(f"tokenizer.ggml.{name}") for key, name in _GGUF_SPECIAL_IDS.items()}
    special_tokens = {key: tokens[i] for key, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    add_bos, add_eos = gguf.get("tokenizer.ggml.add_bos_token"), gguf.get("tokenizer.ggml.add_eos_token")
    _add_bos_eos_processor(backend, special_tokens, ids, add_bos, add_eos)
    eos_ids = (gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id"))
    return Tokenizer(
        backend,
        bos_token_id=ids["bos_token"],
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        chat_template=gguf.get("tokenizer.chat_template"),
        special_tokens=special_tokens,
    )


_GGUF_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _add_bos_eos_processor(
    backend: Backend, special: dict[str, str], ids: dict[str, int | None], add_bos: bool, add_eos: bool
) -> None:
    """encode(add_special_tokens=True) adds BOS/EOS exactly when the GGUF says llama.cpp would."""
    add_bos, add_eos = add_bos and ids["bos_token"] is not None, add_eos and ids["eos_token"] is not None
    if not (add_bos or add_eos):
        return
    prefix = [special["bos_token"]] if add_bos else []
    suffix = [special["eos_token"]] if add_eos else []
    pairs = [(special["bos_token"], ids["bos_token"])] if add_bos else []
    pairs += [(special["eos_token"], ids["eos_token"])] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A", *suffix]), special_tokens=pairs
    )


# ---- Hugging Face directories ----


def _from_hf_dir(path: Path) -> Tokenizer:
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = Backend.from_file(str(tokenizer_json))
    except Exception as e:  # tokenizers raises plain Exception for malformed files
        raise ModelLoadError(f"{tokenizer_json}: cannot load ({' '.join(str(e).split())})") from e
    config = _read_json(path / "tokenizer_config.json")
    special_tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special_tokens[key] = value

    eos_ids = [backend.token_to_id(special_tokens["eos_token"])] if "eos_token" in special_tokens else []
    generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
    eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    bos = special_tokens.get("bos_token")
    return Tokenizer(
        backend,
        bos_token_id=backend.token_to_id(bos) if bos else None,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        chat_template=_hf_chat_template(path, config),
        special_tokens=special_tokens,
    )


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable JSON ({' '.join(str(e).split())})") from e


# ---- chat templates ----


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compiled like transformers does, in a sandbox: templates ship inside model files."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, stopping at the first stop string.

    `push` returns only text that can no longer change: no half UTF-8 characters (decoded text ending in
    U+FFFD waits for the next token) and no tail that could still grow into a stop string. When a stop string
    appears, the text before it is emitted, the stop string and everything after it are dropped, and
    `stopped` becomes True.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.text = ""  # everything emitted so far
        self._ids: list[int] = []
        # Decode from _prefix_offset so that decoders that strip a leading space see the same context twice;
        # ids before _read_offset are already turned into text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""  # stable text kept back because it may be the start of a stop string

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        new = self._unread_text()
        if new.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(self._held + new)

    def flush(self) -> str:
        """Everything still held back (the end of the stream: partial characters decode as U+FFFD)."""
        if self.stopped:
            return ""
        new = self._unread_text()
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(self._held + new, final=True)

    def _unread_text(self) -> str:
        """Text of the ids after _read_offset, decoded in the context of the chunk before them."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._decode(self._ids[self._prefix_offset :])[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _release(self, pending: str, final: bool = False) -> str:
        if not self.stop:  # the common case, once per token of every request: nothing to look for
            return self._emit(pending)
        hits = [(pending.find(s), s) for s in self.stop if s in pending]
        if hits:
            cut = min(hits)[0]
            self.stopped = True
            self._held = ""
            return self._emit(pending[:cut])
        keep = 0 if final else _stop_prefix_length(pending, self.stop)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def _emit(self, text: str) -> str:
        self.text += text
        return text


def _stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if s.startswith(text[-n:]):
                longest = n
                break
    return longest
