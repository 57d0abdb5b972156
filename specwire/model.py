"""Llama-family decoder (Llama, Llama 3 RoPE, Qwen2 qkv bias, Mistral without sliding window, SmolLM).

One forward serves batched prefill, decode and verify over a slot-indexed static KV cache. q/k/v and
gate/up are fused into one matmul each at load time: the small-model GPU step is bound by kernel launches.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from specwire.config import ModelConfig
from specwire.kernels import ops
from specwire.weights import check_tensors, checkpoint_shapes


class KVCache:
    """k, v: [num_layers, num_slots + 1, num_kv_heads, max_context, head_dim]; slot num_slots is the trash."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, max_context: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (config.num_layers, num_slots + 1, config.num_kv_heads, max_context, config.head_dim)
        # Zeros, not empty: padded rows may read never-written positions and must stay finite.
        k = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k, torch.zeros_like(k))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1] - 1

    @property
    def trash_slot(self) -> int:
        return self.k.shape[1] - 1

    @property
    def max_context(self) -> int:
        return self.k.shape[3]


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # float32 [len(logits_index), V]
    hidden: torch.Tensor  # final normed hidden state [B, T, H]
    aux_hidden: torch.Tensor | None  # residual stream entering each aux layer, [B, T, len(aux) * H]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, as transformers computes them (default or llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # transformers' _compute_llama3_parameters: keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly in between.
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos in the first head_dim/2 columns, sin in the last (ops.rope)."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(config)[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Linear(nn.Linear):
    """nn.Linear whose weight can be reordered once into oneDNN's blocked layout for fp32 CPU inference.

    On the 2-core AVX2 CPU, MKL's sgemm (2+ rows) repacks the weight on every call and its sgemv (1 row)
    runs on one core: a SmolLM2-135M verify of 3 or 5 tokens cost 147 or 131 ms against 74 ms for a decode.
    oneDNN with the weight reordered once takes 68, 70 and 61 ms (medians of 9 runs, 2026-11-23).
    """

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Freeze the current weight for inference: later changes to .weight are not seen; no autograd."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_for_cpu(module: nn.Module) -> None:
    """Pack every fp32 CPU Linear of an inference-only module (see Linear); other devices and dtypes keep
    nn.Linear's matmul."""
    if not torch.backends.mkldnn.is_available():
        return
    for m in module.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            m.pack_for_cpu()


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device) -> Linear:
    # Left uninitialised: load_weights overwrites every parameter.
    return nn.utils.skip_init(Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


def _norm_weight(config: ModelConfig, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = _linear(c.hidden_size, q_size + 2 * kv_size, c.attention_bias, dtype, device)
        self.o_proj = _linear(q_size, c.hidden_size, False, dtype, device)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q = ops.rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, start_pos, num_tokens)
        out = ops.attention(q, k_cache, v_cache, slots, start_pos, num_tokens, self.scale)
        return self.o_proj(out.flatten(-2))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    # No forward: LlamaModel.forward runs the layers so that the EAGLE taps can read the residual stream
    # straight out of the fused add + norm, without an extra add per tapped layer.
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = _norm_weight(config, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = _norm_weight(config, dtype, device)
        self.mlp = MLP(config, dtype, device)


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        """max_positions sizes the RoPE table (default: config.max_position_embeddings)."""
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.embed_tokens = nn.utils.skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = _norm_weight(config, dtype, device)
        # Tied: the head shares the embedding, so its own weight is never allocated (meta device).
        tied = config.tie_word_embeddings
        head_device = "meta" if tied else device
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, head_device)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        cos_sin = rope_cos_sin(config, max_positions or config.max_position_embeddings)
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)
        self.requires_grad_(False)

    # ------------------------------------------------------------------------------------------ weights

    def _check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        # Tolerated extras: old checkpoints store RoPE buffers; some tied checkpoints still store lm_head.
        tied = self.config.tie_word_embeddings
        kept = {n: t for n, t in state_dict.items()
                if not n.endswith("rotary_emb.inv_freq") and not (tied and n == "lm_head.weight")}
        check_tensors(kept, checkpoint_shapes(self.config), "checkpoint")

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in (any float dtype); fuses q/k/v and gate/up; on an fp32 CPU
        model, reorders the linear weights for oneDNN (Linear)."""
        self._check_state_dict(state_dict)
        sd = state_dict
        self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
        self.norm.copy_(sd["model.norm.weight"])
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(sd["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.copy_(sd[p + "post_attention_layernorm.weight"])
            qkv = [p + f"self_attn.{x}_proj." for x in "qkv"]
            attn.qkv_proj.weight.copy_(torch.cat([sd[n + "weight"] for n in qkv]))
            if self.config.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat([sd[n + "bias"] for n in qkv]))
            attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            gate_up = [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            mlp.gate_up_proj.weight.copy_(torch.cat(gate_up))
            mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
        pack_for_cpu(self)

    # ------------------------------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor, slots: torch.Tensor,
        cache: KVCache, logits_index: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        """Row b feeds num_tokens[b] new tokens at positions start_pos[b] + i into cache slot slots[b].

        No host syncs or data-dependent shapes (CUDA-graph capturable when logits_index is a tensor).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if bad := [i for i in aux_layers if not 0 <= i < self.config.num_layers]:
            raise ValueError(f"aux layer {bad[0]} out of range for {self.config.num_layers} layers")
        eps = self.config.rms_norm_eps
        positions = start_pos[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)

        hidden, residual = self.embed_tokens(input_ids), None
        taps = {}
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, hidden = hidden, ops.rms_norm(hidden, layer.input_layernorm, eps)
            else:
                hidden, residual = ops.add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            if i in aux_layers:  # add_rms_norm returns a fresh residual, so this stays valid
                taps[i] = residual
            hidden = layer.self_attn(
                hidden, positions, self.cos_sin, cache.k[i], cache.v[i], slots, start_pos, num_tokens
            )
            hidden, residual = ops.add_rms_norm(hidden, residual, layer.post_attention_layernorm, eps)
            hidden = layer.mlp(hidden)
        hidden, _ = ops.add_rms_norm(hidden, residual, self.norm, eps)

        flat = hidden.flatten(0, 1)
        if logits_index is not None:
            flat = flat.index_select(0, logits_index)
        logits = self.lm_head(flat).float()
        aux = torch.cat([taps[i] for i in aux_layers], dim=-1) if aux_layers else None
        return ModelOutput(logits, hidden, aux)
