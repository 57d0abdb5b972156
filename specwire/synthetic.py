"""Synthetic models (`--model synthetic:NAME`): a real model's shapes with random weights built on the device,
and a deterministic byte-level tokenizer of the same vocabulary size. For benchmarks at realistic step times
with nothing to download or carry; their output is noise.

Every process that names the same shape builds the same tensors: each tensor comes from its own generator,
seeded from the tensor's name, so a drafter can build only the embedding and lm_head it shares with the
target. Generators of one device type give the same numbers (torch's CUDA generator also depends on the GPU
model); a drafter on another device type gets other shared tensors, which changes the drafts' ids (noise
either way), never what runs or how fast.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from specwire.config import ModelConfig
from specwire.errors import ModelLoadError
from specwire.tokenizer import Tokenizer
from specwire.weights import checkpoint_shapes

PREFIX = "synthetic:"
RANDOM_HEAD = "random"  # --head random: an EAGLE-3 head of the target's shape with random weights
SEED = 0
WEIGHT_STD = 0.02

# The real models whose shapes synthetic models take (bos/eos follow the synthetic tokenizer, see below).
SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # For CPU tests: Llama-3-like (untied, GQA, llama3 rope scaling) at a size a 2-core machine steps in ms.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
}

# Token ids of the synthetic tokenizer: the 256 bytes, these special tokens, then fillers `<tN>`.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def synthetic_shape(model: str | Path | None) -> str | None:
    """The shape name of a `synthetic:NAME` model argument, None for anything else (a path or the default)."""
    if model is None or not str(model).startswith(PREFIX):
        return None
    name = str(model).removeprefix(PREFIX)
    if name not in SHAPES:
        raise ModelLoadError(f"unknown synthetic model {name!r} (choose from {', '.join(sorted(SHAPES))})")
    return name


def head_or_random(model: str | Path | None, head: str | None) -> str | None:
    """A drafter's --head: as given, or RANDOM_HEAD for a synthetic model given none."""
    return RANDOM_HEAD if head is None and synthetic_shape(model) is not None else head


def synthetic_config(name: str) -> ModelConfig:
    """SHAPES[name] with the synthetic tokenizer's bos and eos ids."""
    return replace(SHAPES[name], bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))


def synthetic_weights(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Random tensors (HF Llama names) for `config`, generated on `device` in `dtype`: norms are ones, every
    matrix N(0, WEIGHT_STD^2). `names` picks a subset (a drafter needs only the shared embedding and lm_head);
    each tensor is the same whichever subset asks for it."""
    shapes = checkpoint_shapes(config)
    wanted = shapes if names is None else {n: shapes[n] for n in names if n in shapes}
    out = {}
    for name, shape in wanted.items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(SEED << 32 | zlib.crc32(name.encode()))
        tensor = torch.empty(shape, dtype=dtype, device=device)
        out[name] = tensor.normal_(0.0, WEIGHT_STD, generator=generator)
    return out


def synthetic_tokenizer(config: ModelConfig) -> Tokenizer:
    """Byte-level tokenizer with exactly config.vocab_size ids: every byte of the text is one token (no
    merges), then SPECIAL_TOKENS, then fillers `<tN>` that only the model emits (they decode to that text).
    Built from the vocabulary size alone, so every process with the same shape has the same fingerprint."""
    specials = len(SPECIAL_TOKENS)
    if config.vocab_size < 256 + specials:
        raise ModelLoadError(f"a synthetic model needs a vocabulary of at least {256 + specials} tokens")
    vocab = {char: i for i, char in enumerate(_byte_alphabet())}
    vocab |= {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"<t{i}>": i for i in range(256 + specials, config.vocab_size)}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(
        backend,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        chat_template=CHAT_TEMPLATE,
        special_tokens={"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]},
    )


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (what the ByteLevel pre-tokenizer emits)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
