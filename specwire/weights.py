"""Load a checkpoint (HF directory or GGUF file) as a ModelConfig and float32 tensors with HF Llama names."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specwire.config import ModelConfig
from specwire.errors import ModelLoadError
from specwire.gguf_file import GGUFFile

GGUF_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor names (llama.cpp) -> Hugging Face names; `blk.{i}.` maps to `model.layers.{i}.`.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint for `config` must provide."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if config.attention_bias:  # Qwen2: q/k/v carry a bias, o_proj does not
        layer |= {f"self_attn.{p}_proj.bias": layer[f"self_attn.{p}_proj.weight"][:1] for p in "qkv"}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    shapes |= {f"model.layers.{i}.{n}": s for i in range(config.num_layers) for n, s in layer.items()}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_tensors(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str,
    allow_extra: bool = False,
) -> None:
    """Raise ModelLoadError naming the first missing, unexpected (unless allowed) or misshapen tensor."""
    if missing := sorted(expected.keys() - tensors.keys()):
        raise ModelLoadError(f"{what} is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if not allow_extra and (unexpected := sorted(tensors.keys() - expected.keys())):
        raise ModelLoadError(
            f"{what} has unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)"
        )
    for name, shape in expected.items():
        if (actual := tuple(tensors[name].shape)) != shape:
            raise ModelLoadError(f"{what} tensor {name!r} has shape {actual}, expected {shape}")


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, float32 tensors) from a HF directory (config.json + safetensors) or a .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    config, tensors = _load_hf_dir(path) if path.is_dir() else _load_gguf(path)
    expected = checkpoint_shapes(config)
    check_tensors(tensors, expected, f"{path}: checkpoint", allow_extra=True)
    return config, {name: tensors[name] for name in expected}


# ---- Hugging Face directories ----


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: directory has no config.json (expected a Hugging Face model dir)")
    try:
        config = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: cannot use this config ({_one_line(e)})") from e
    wanted = checkpoint_shapes(config)
    tensors = {}
    for file in _weight_files(path):
        for name, tensor in _read_weight_file(file).items():
            if name in wanted:
                tensors[name] = tensor.float()
    return config, tensors


def _weight_files(path: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
                raise ModelLoadError(f"{index}: unreadable shard index ({_one_line(e)})") from e
            files = [path / shard for shard in shards]
            for file in files:
                if not file.is_file():
                    raise ModelLoadError(f"{index}: shard {file.name} is missing")
            return files
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no weights (model.safetensors, shards or pytorch_model.bin)")
    return files


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(file)
        # Never unpickle arbitrary objects from a user file.
        return torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{file}: cannot read weights ({_one_line(e)})") from e


# ---- GGUF files ----


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    gguf = GGUFFile.open(path)
    config = _gguf_config(gguf)
    # llama.cpp's converter permutes Q/K rows for "llama" only; qwen2 keeps the HF order.
    permuted = gguf.get("general.architecture") == "llama"
    tensors = {}
    for gguf_name in gguf.tensors:
        name = _hf_name(gguf_name)
        if name is None:
            continue  # rope_freqs is folded into the config; anything else is not part of a Llama decoder
        array = gguf.tensor(gguf_name)
        if permuted and ".self_attn.q_proj." in name:
            array = _unpermute_rows(array, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            array = _unpermute_rows(array, config.num_kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
    return config, tensors


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: its converter interleaves the two rotary halves of every head."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(f"{gguf.path}: unsupported GGUF architecture {arch!r} (supported: {supported})")
    if "token_embd.weight" not in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: checkpoint is missing tensor token_embd.weight")

    def hparam(key: str, default: object = None) -> object:
        return gguf.require(f"{arch}.{key}") if default is None else gguf.get(f"{arch}.{key}", default)

    hidden = int(hparam("embedding_length"))
    num_heads = int(hparam("attention.head_count"))
    num_kv_heads = hparam("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ModelLoadError(f"{gguf.path}: per-layer attention.head_count_kv is not supported")
    head_dim = int(hparam("attention.key_length", hidden // num_heads))
    rope_dim = int(hparam("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{gguf.path}: partial rotary ({rope_dim} of {head_dim} dims) is unsupported")
    rope_theta = float(hparam("rope.freq_base", 10000.0))
    eos_ids = (gguf.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
    try:
        return ModelConfig(
            vocab_size=gguf.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(hparam("feed_forward_length")),
            num_layers=int(hparam("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hparam("attention.layer_norm_rms_epsilon")),
            rope_theta=rope_theta,
            rope_scaling=_gguf_rope_scaling(gguf, arch, rope_theta, head_dim),
            max_position_embeddings=int(hparam("context_length", 2048)),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias="blk.0.attn_q.bias" in gguf.tensors,
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        )
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: {_one_line(e)}") from e


def _gguf_rope_scaling(gguf: GGUFFile, arch: str, theta: float, head_dim: int) -> dict | None:
    scaling_type = gguf.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise ModelLoadError(f"{gguf.path}: unsupported rope scaling type {scaling_type!r}")
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    # Llama 3.x: llama.cpp stores the per-frequency divisors, not the parameters that produced them.
    divisors = gguf.tensor("rope_freqs.weight").astype(np.float64)
    original = int(gguf.get(f"{arch}.rope.scaling.original_context_length", 8192))
    scaling = llama3_scaling_from_divisors(divisors, theta, head_dim, original)
    if scaling is None:
        raise ModelLoadError(f"{gguf.path}: rope_freqs does not match Llama-3 rope scaling")
    return scaling


def llama3_rope_divisors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """What each rotary frequency is divided by under HF's "llama3" rope scaling."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    smooth = (context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, medium))


def llama3_scaling_from_divisors(
    divisors: np.ndarray, theta: float, head_dim: int, original_context: int
) -> dict | None:
    """Recover HF "llama3" rope_scaling from llama.cpp's rope_freqs, or None when it is not of that form.

    Between the two cut-offs 1 / divisor is linear in 1 / wavelength; two or more such frequencies fix
    low_freq_factor and high_freq_factor for the given original context.
    """
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    medium = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if medium.sum() < 2:
        return None
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[medium], smooth, 1)
    low = -intercept * original_context / slope
    high = low + original_context / slope
    # Rounded: the stored divisors are float32, the parameters behind them are short decimals (8, 1, 4).
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": original_context,
    }
    if not np.allclose(llama3_rope_divisors(scaling, theta, head_dim), divisors, rtol=1e-4):
        return None
    return scaling


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
