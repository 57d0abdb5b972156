"""Model configuration: the few numbers that define a Llama-family decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Per-type defaults for keys a config.json may omit (the values transformers' config classes use).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"max_position_embeddings": 32768},
    "mistral": {"max_position_embeddings": 4096 * 32},
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF keys: rope_type="llama3", factor, low/high_freq_factor, original_max_...
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2); o_proj never does
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (model_type llama, qwen2 or mistral)."""
        model_type = d.get("model_type")
        if model_type not in _DEFAULTS:
            raise ValueError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(_DEFAULTS))})"
            )
        d = {**_DEFAULTS[model_type], **d}
        max_pos = int(d["max_position_embeddings"])
        _check_no_sliding_window(model_type, d, max_pos)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=True")
        if model_type == "qwen2":
            attention_bias = True
        elif d.get("attention_bias", False):
            raise ValueError(f"unsupported attention_bias=True for {model_type} (o_proj bias)")
        else:
            attention_bias = False

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(d)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
        )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps: low, middle and high layers (SafeAILab EAGLE, vLLM); the verifier taps them too."""
    return (2, num_layers // 2, num_layers - 3)


def _check_no_sliding_window(model_type: str, d: dict[str, Any], max_pos: int) -> None:
    window = d.get("sliding_window")
    active = window is not None and int(window) < max_pos
    if model_type == "qwen2":
        active = active and bool(d.get("use_sliding_window", False))
    if active:
        raise ValueError(
            f"unsupported sliding_window={window} < max_position_embeddings={max_pos} ({model_type})"
        )


def _rope(d: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None), from transformers 5 `rope_parameters` or 4.x `rope_scaling`."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        supported = ", ".join(_SUPPORTED_ROPE_TYPES)
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {supported})")
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": "llama3"}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise ValueError(f"llama3 rope scaling is missing {key!r}")
        scaling[key] = params[key]
    return theta, scaling


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)
