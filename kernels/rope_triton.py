"""RoPE and the KV-cache write, alone or fused into one launch (one program per token, all heads).

`rope_write_kv` is the layer's path: rotate q and k, write the rotated k and v into the cache, return q.
`rope` and `write_kv` are the same kernel with one half switched off.
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])  # as attention_triton's kernel: one variant for every prefill width
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
    positions_ptr, cos_sin_ptr, slots_ptr, start_pos_ptr, num_tokens_ptr,
    T, num_positions, capacity, trash_slot,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_cs, stride_ch, stride_cc,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, ROPE: tl.constexpr, WRITE_CACHE: tl.constexpr,
):
    token = tl.program_id(0)
    b = token // T
    i = token % T
    d = tl.arange(0, HALF)[None, :]
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = kv_heads < NUM_KV_HEADS
    k_src = k_ptr + b * stride_kb + i * stride_kt + kv_heads * stride_kh + d
    k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    if ROPE:
        # Clamped so padded tokens with any position stay inside the table.
        pos = tl.load(positions_ptr + token)
        pos = tl.minimum(tl.maximum(pos, 0), num_positions - 1).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * 2 * HALF + d)
        sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + d)
        q_heads = tl.arange(0, BLOCK_HQ)[:, None]
        q_mask = q_heads < NUM_Q_HEADS
        q_src = q_ptr + b * stride_qb + i * stride_qt + q_heads * stride_qh + d
        q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
        q_dst = q_out_ptr + token.to(tl.int64) * NUM_Q_HEADS * 2 * HALF + q_heads * 2 * HALF + d
        tl.store(q_dst, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_dst + HALF, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)
        k_rot1 = k1 * cos - k2 * sin
        k2 = k2 * cos + k1 * sin
        k1 = k_rot1
    if WRITE_CACHE:
        # Padded tokens (and any past the cache's end) go to the trash slot at position 0.
        dest = tl.load(start_pos_ptr + b) + i
        live = (i < tl.load(num_tokens_ptr + b)) & (dest < capacity)
        slot = tl.where(live, tl.load(slots_ptr + b), trash_slot).to(tl.int64)
        dest = tl.where(live, dest, 0)
        offset = slot * stride_cs + kv_heads * stride_ch + dest * stride_cc + d
        tl.store(k_cache_ptr + offset, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + offset + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_src = v_ptr + b * stride_vb + i * stride_vt + kv_heads * stride_vh + d
        v1 = tl.load(v_src, mask=kv_mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + offset, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + offset + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    else:
        k_dst = k_out_ptr + token.to(tl.int64) * NUM_KV_HEADS * 2 * HALF + kv_heads * 2 * HALF + d
        tl.store(k_dst, k1.to(k_out_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HALF, k2.to(k_out_ptr.dtype.element_ty), mask=kv_mask)


def _head_strides(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    if x.dim() != 4 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [B, T, H, D] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(q, k, v, positions, cos_sin, k_cache_l, v_cache_l, slots, start_pos, num_tokens):
    """q is None for write_kv only; the caches are None for rope only. Returns (q_out, k_out)."""
    B, T, num_kv_heads, head_dim = k.shape
    rope_on, cache_on = q is not None, k_cache_l is not None
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rope_on else None
    k_out = None if cache_on else torch.empty(k.shape, dtype=q.dtype, device=k.device)
    if cache_on and k_cache_l.shape[1:] != (num_kv_heads, k_cache_l.shape[2], head_dim):
        raise ValueError(f"cache layer shape {tuple(k_cache_l.shape)} does not fit k {tuple(k.shape)}")
    if cache_on and (k_cache_l.stride() != v_cache_l.stride() or k_cache_l.stride(-1) != 1):
        raise ValueError("k and v cache layers must share strides and have a contiguous last dim")
    if rope_on and cos_sin.shape[-1] != head_dim:
        raise ValueError(f"cos_sin width {cos_sin.shape[-1]} does not match head_dim {head_dim}")
    if B * T == 0:
        return q_out, k_out
    any_ = k  # stands in for pointers a disabled half never touches
    _rope_write_kv_kernel[(B * T,)](
        q if rope_on else any_, k, v if cache_on else any_, q_out if rope_on else any_,
        k_out if k_out is not None else any_, k_cache_l if cache_on else any_,
        v_cache_l if cache_on else any_,
        positions.contiguous() if rope_on else any_, cos_sin.contiguous() if rope_on else any_,
        slots if cache_on else any_, start_pos if cache_on else any_, num_tokens if cache_on else any_,
        T, cos_sin.shape[0] if rope_on else 1,
        k_cache_l.shape[2] if cache_on else 0, k_cache_l.shape[0] - 1 if cache_on else 0,
        *(_head_strides(q, "q") if rope_on else (0, 0, 0)), *_head_strides(k, "k"),
        *(_head_strides(v, "v") if cache_on else (0, 0, 0)),
        *(k_cache_l.stride()[:3] if cache_on else (0, 0, 0)),
        NUM_Q_HEADS=q.shape[2] if rope_on else 1, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(q.shape[2]) if rope_on else 1,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), ROPE=rope_on, WRITE_CACHE=cache_on, num_warps=4,
    )
    return q_out, k_out


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, None, positions, cos_sin, None, None, None, None, None)


def write_kv(
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slots: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
) -> None:
    _launch(None, k, v, None, None, k_cache_l, v_cache_l, slots, start_pos, num_tokens)


def rope_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    return _launch(q, k, v, positions, cos_sin, k_cache_l, v_cache_l, slots, start_pos, num_tokens)[0]
