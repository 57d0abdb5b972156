"""Flash attention over the paged-by-slot KV cache, for prefill, decode and verify in one kernel.

One program per (row, kv head, M block). The M dimension packs the new tokens and the query heads of one GQA
group (m = token * group + head_in_group), so every key block is loaded once for the whole group. Each program
reads keys 0 .. start_pos + (its last live token) only; the bound comes from device tensors inside the kernel,
so the launch is CUDA-graph safe (grid depends on shapes only, no host sync).
"""

import math

import torch
import triton
import triton.language as tl

_MASKED = tl.constexpr(-1.0e30)  # finite, so a fully masked (padded) query row never produces NaN


# T (tokens a row feeds) is not specialised: Triton would compile another variant the first time a prefill's
# T is a multiple of 16: a ~1 s stall of every stream mid-serving (seen on H200s: bench/results/session16).
@triton.jit(do_not_specialize=["T"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, slots_ptr, start_pos_ptr, num_tokens_ptr,
    qk_scale, T, capacity,
    stride_qb, stride_qt, stride_qh, stride_cs, stride_ch, stride_cc, stride_ob, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    num_tokens = tl.load(num_tokens_ptr + b)
    start = tl.load(start_pos_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_live = (token < num_tokens) & (m < T * GROUP)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_live[:, None], other=0.0)

    # Keys this block needs: 0 .. start + its last live token (none when the block has no live token).
    first_token = m_block * BLOCK_M // GROUP
    last_token = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, num_tokens - 1)
    kv_end = tl.where(first_token < num_tokens, tl.minimum(start + last_token + 1, capacity), 0)
    last_visible = start + token  # per query row, inclusive

    k_base = k_cache_ptr + slot * stride_cs + kv_head * stride_ch
    v_base = v_cache_ptr + slot * stride_cs + kv_head * stride_ch
    m_i = tl.full([BLOCK_M], _MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_cache = j < kv_end
        k = tl.load(k_base + j[:, None] * stride_cc + d[None, :], mask=in_cache[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (j[None, :] <= last_visible[:, None]) & in_cache[None, :] & row_live[:, None]
        s = tl.where(visible, s, _MASKED)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + j[:, None] * stride_cc + d[None, :], mask=in_cache[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = tl.where(row_live[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ptrs = out_ptr + b * stride_ob + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(m < T * GROUP)[:, None])


def _launch_config(head_dim: int, elem_bytes: int, m_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). One arithmetic for every forward: tiles of 64 query rows per
    4 warps (a prefill's 128 rows per 8 warps are two such halves) and one key-block length, so that a query
    row's result does not depend on how many rows share its launch. A prompt carried by a verification in rows
    of 5 (engine carry_rows) then gets the keys and values its prefill would, bit for bit in bf16, and greedy
    output does not depend on when a request arrived. Smaller tiles for decode rows ran another MMA path,
    about one bf16 step away (bench/results/session26/; the 8B verify step there was 2% faster)."""
    block_n = 64 if head_dim * elem_bytes > 128 else 128
    if m_rows > 64:
        return 128, block_n, 8, 2
    return 64, block_n, 4, 2


def attention(
    q: torch.Tensor, k_cache_l: torch.Tensor, v_cache_l: torch.Tensor, slots: torch.Tensor,
    start_pos: torch.Tensor, num_tokens: torch.Tensor, scale: float,
) -> torch.Tensor:
    B, T, num_q_heads, head_dim = q.shape
    _, num_kv_heads, capacity, cache_dim = k_cache_l.shape
    if num_q_heads % num_kv_heads or cache_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache layer {tuple(k_cache_l.shape)}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or k_cache_l.stride(-1) != 1 or k_cache_l.stride() != v_cache_l.stride():
        raise ValueError("q and the cache layers need a contiguous last dim; k and v caches equal strides")
    group = num_q_heads // num_kv_heads
    out = torch.empty(B, T, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    block_m, block_n, num_warps, num_stages = _launch_config(head_dim, k_cache_l.element_size(), T * group)
    grid = (B, num_kv_heads, triton.cdiv(T * group, block_m))
    if out.numel() == 0:
        return out
    _attention_kernel[grid](
        q, k_cache_l, v_cache_l, out, slots, start_pos, num_tokens, scale * math.log2(math.e), T, capacity,
        *q.stride()[:3], *k_cache_l.stride()[:3], *out.stride()[:3],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
