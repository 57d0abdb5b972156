"""Llama layer ops, and the engine's feed of rows from a sampler: Triton kernels on CUDA, plain-PyTorch
references elsewhere.

Each public op dispatches to its Triton kernel when the input lives on CUDA and SPECWIRE_TORCH_OPS is not
"1"; otherwise it runs the `*_ref` function beside it. The references are the CPU path and the test oracle.

Shapes: q [B, T, Hq, D], k/v [B, T, Hkv, D], one cache layer [S + 1, Hkv, C, D] where slot S is the trash
slot. Row b holds num_tokens[b] (0..T) new tokens at absolute positions start_pos[b] + i.
"""

import os

import torch
import torch.nn.functional as F

try:  # CPU-only installs may lack Triton; they run the references.
    from specwire.kernels import activation_triton, attention_triton, follow_triton, norm_triton, rope_triton

    _HAVE_TRITON = True
except ImportError:
    _HAVE_TRITON = False


def _triton_enabled(t: torch.Tensor) -> bool:
    return _HAVE_TRITON and t.is_cuda and os.environ.get("SPECWIRE_TORCH_OPS") != "1"


# --------------------------------------------------------------------------------------------- references


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back to x's dtype, then scale by w."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w * y.to(x.dtype)).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, w, eps), new_residual


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rotate_half RoPE. cos_sin [P, D]: cos in the first D/2 columns, sin in the last D/2.

    Positions are clamped to the table so that padded tokens with any position stay in bounds.
    """
    half = q.shape[-1] // 2
    table = cos_sin[positions.long().clamp(0, cos_sin.shape[0] - 1)].unsqueeze(-2)  # [B, T, 1, D]
    cos, sin = table[..., :half], table[..., half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().split(half, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)

    return rotate(q), rotate(k)


def _cache_destination(
    cache_shape: torch.Size, num_new: int, slots: torch.Tensor, start_pos: torch.Tensor,
    num_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, position) [B, T] for every new token; padded or out-of-cache tokens go to (trash, 0)."""
    trash, capacity = cache_shape[0] - 1, cache_shape[2]
    i = torch.arange(num_new, device=slots.device)
    pos = start_pos.long()[:, None] + i
    live = (i < num_tokens.long()[:, None]) & (pos < capacity)
    slot = torch.where(live, slots.long()[:, None], trash)
    return slot, torch.where(live, pos, 0)


def write_kv_ref(
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slots: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
) -> None:
    """In place: token i of row b to cache[slots[b], :, start_pos[b] + i]; padded tokens to (trash, 0)."""
    slot, pos = _cache_destination(k_cache_l.shape, k.shape[1], slots, start_pos, num_tokens)
    k_cache_l[slot, :, pos] = k.to(k_cache_l.dtype)
    v_cache_l[slot, :, pos] = v.to(v_cache_l.dtype)


def rope_write_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """rope on q and k, then write_kv of the rotated k and v; returns the rotated q."""
    q_rot, k_rot = rope_ref(q, k, positions, cos_sin)
    write_kv_ref(k_cache_l, v_cache_l, k_rot, v, slots, start_pos, num_tokens)
    return q_rot


def attention_ref(
    q: torch.Tensor, k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor,
    start_pos: torch.Tensor, num_tokens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """GQA over the cache: query i < num_tokens[b] sees positions 0..start_pos[b] + i of slot slots[b].

    Padded query rows return zeros. Scores and softmax in float32.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache_l.shape[1]
    kv_len = k_cache_l.shape[2]
    if not q.is_cuda:  # Gather only positions some query can see; the host sync is free on CPU.
        kv_len = max(int((start_pos + num_tokens).max()), 1)
    index = slots.long()
    keys, values = k_cache_l[index, :, :kv_len], v_cache_l[index, :, :kv_len]  # [B, Hkv, kv_len, D]
    qg = q.float().reshape(B, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    scores = torch.einsum("bhgtd,bhcd->bhgtc", qg, keys.float()) * scale
    i = torch.arange(T, device=q.device)
    j = torch.arange(keys.shape[2], device=q.device)
    row_live = i[None, :] < num_tokens.long()[:, None]  # [B, T]
    visible = (j[None, None, :] <= start_pos.long()[:, None, None] + i[None, :, None]) & row_live[..., None]
    probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    probs = probs.masked_fill(~row_live[:, None, None, :, None], 0.0)  # all-masked rows are NaN -> 0
    out = torch.einsum("bhgtc,bhcd->bhgtd", probs, values.float())
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def follow_sampler_ref(ids: torch.Tensor, positions: torch.Tensor, packed: torch.Tensor, vocab_size: int
                       ) -> None:
    rows = packed.shape[0]
    count = packed[:, :1].clamp(1, packed.shape[1] - 1)
    ids[:rows, :1].copy_(packed.gather(1, count).clamp_(0, vocab_size - 1))
    positions[:rows].add_(count.view(-1).to(positions.dtype))


# --------------------------------------------------------------------------------------------- public ops


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton_enabled(x):
        return norm_triton.rms_norm(x, w, eps)
    return rms_norm_ref(x, w, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); one kernel on CUDA."""
    if _triton_enabled(x):
        return norm_triton.add_rms_norm(x, residual, w, eps)
    return add_rms_norm_ref(x, residual, w, eps)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_enabled(q):
        return rope_triton.rope(q, k, positions, cos_sin)
    return rope_ref(q, k, positions, cos_sin)


def write_kv(
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slots: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
) -> None:
    if _triton_enabled(k):
        rope_triton.write_kv(k_cache_l, v_cache_l, k, v, slots, start_pos, num_tokens)
    else:
        write_kv_ref(k_cache_l, v_cache_l, k, v, slots, start_pos, num_tokens)


def rope_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """rope + write_kv in one launch on CUDA; returns the rotated q. q, k, v may be views of one qkv."""
    if _triton_enabled(q):
        return rope_triton.rope_write_kv(
            q, k, v, positions, cos_sin, k_cache_l, v_cache_l, slots, start_pos, num_tokens
        )
    return rope_write_kv_ref(q, k, v, positions, cos_sin, k_cache_l, v_cache_l, slots, start_pos, num_tokens)


def attention(
    q: torch.Tensor, k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor,
    start_pos: torch.Tensor, num_tokens: torch.Tensor, scale: float,
) -> torch.Tensor:
    if _triton_enabled(q):
        return attention_triton.attention(q, k_cache_l, v_cache_l, slots, start_pos, num_tokens, scale)
    return attention_ref(q, k_cache_l, v_cache_l, slots, start_pos, num_tokens, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    if _triton_enabled(x):
        return activation_triton.silu_and_mul(x)
    return silu_and_mul_ref(x)


def follow_sampler(ids: torch.Tensor, positions: torch.Tensor, packed: torch.Tensor, vocab_size: int) -> None:
    """Rows that continue where a sampler left them, set on the device without a wait for the host:
    ids[b, 0] = the last token the sampler emitted for row b and positions[b] += how many it emitted
    (packed [B, 2 + k]: count, then the tokens, as SampleOutput holds them). Clamped, so that a row the
    sampler marked bad (count -1, which fails that round on the host) feeds a valid id. On CUDA one launch
    (follow_triton) on the current device: the engine's steps run in device_scope."""
    if _triton_enabled(packed):
        follow_triton.follow(ids, positions, packed, vocab_size)
    else:
        follow_sampler_ref(ids, positions, packed, vocab_size)
