"""The rejection sampler as one Triton kernel; semantics in rejection_sampler_ref (the oracle).

One program per target row. Pass 1 streams the row's logits once: the online softmax max and sum (only
when the row checks a draft against a dense or sparse q), the argmax (greedy rows), and the exponential race
for the row's sample, in log space so it needs no normalisation. With a one-hot q the race winner is the
row's token and the draft passes iff it won, so one pass decides the row. A sparse q is handled in the same
pass: its support S is excluded from the race (a per-row bitmap) and re-enters with residual keys computed
from the K entries afterwards. A dense q needs the normalised p inside max(0, p - q), so a second pass runs,
but only in rows whose own acceptance test failed. If rounding leaves a residual without mass, one more pass
samples from p (rare). Vocab draws come four per Philox call.

Each program writes its row's token and state, then takes a ticket from its request's counter; the last row
of a request to finish assembles the request's output (count, then the accepted prefix plus one token).
NaN/+inf logits, rows with no finite logit, and NaN/inf/negative q values read by the kernel mark the row
bad, and its request's count becomes -1, which SampleOutput turns into SamplerInputError when read. A dense
q is checked where it is read: at q(x) always, and the whole row when that row's residual is needed.
"""

import functools

import torch
import triton
import triton.language as tl
from specwire.kernels import rejection_sampler_ref as ref
from specwire.kernels.rejection_sampler_ref import SampleOutput, SamplerBatch

Q_ONE_HOT, Q_DENSE, Q_SPARSE = 0, 1, 2
# Kernels read module globals only as constexprs.
SALT, STREAM_TOKEN, STREAM_ACCEPT = (tl.constexpr(v) for v in (ref.SALT, ref.STREAM_TOKEN, ref.STREAM_ACCEPT))


@triton.jit
def _philox_uniforms(seed, c0, pos, STREAM: tl.constexpr):
    """Four uniform blocks for counters (c0, pos, STREAM, SALT), as philox.philox_uniforms draws them."""
    c1 = tl.zeros_like(c0) + pos
    c2 = tl.zeros_like(c0) + STREAM
    c3 = tl.zeros_like(c0) + SALT
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    return (tl.uint_to_uniform_float(w0), tl.uint_to_uniform_float(w1), tl.uint_to_uniform_float(w2),
            tl.uint_to_uniform_float(w3))


@triton.jit
def _pick_lane(lane, u0, u1, u2, u3):
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@triton.jit
def _tile_uniforms(seed, pos, start, BQ: tl.constexpr):
    """Uniforms [BQ, 4] for vocab entries start + 4a + lane: one Philox call per four entries."""
    a = tl.arange(0, BQ)
    u0, u1, u2, u3 = _philox_uniforms(seed, (start // 4 + a).to(tl.int32), pos, STREAM_TOKEN)
    lane = tl.arange(0, 4)[None, :]
    return _pick_lane(lane, u0[:, None], u1[:, None], u2[:, None], u3[:, None])


@triton.jit
def _entry_uniforms(seed, pos, idx):
    """Uniforms for scattered vocab entries idx (int32 block)."""
    u0, u1, u2, u3 = _philox_uniforms(seed, idx // 4, pos, STREAM_TOKEN)
    return _pick_lane(idx % 4, u0, u1, u2, u3)


@triton.jit
def _scalar(value, dtype: tl.constexpr):
    return tl.full([], value, dtype)


@triton.jit
def _keep_best(best, best_idx, key, offs, V):
    """Running argmax with the lowest index on ties (tiles arrive in increasing index order)."""
    tile_best = tl.max(tl.max(key, 1), 0)
    tile_idx = tl.min(tl.min(tl.where(key == tile_best, offs, V), 1), 0)
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_idx, best_idx)


@triton.jit
def _bad_logits(logits):
    return tl.max(tl.max(((logits != logits) | (logits == float("inf"))).to(tl.int32), 1), 0)


@triton.jit
def _argmax_pass(row_ptr, V, BQ: tl.constexpr):
    offs0 = tl.arange(0, BQ)[:, None] * 4 + tl.arange(0, 4)[None, :]
    best, best_idx, bad = _scalar(float("-inf"), tl.float32), _scalar(0, tl.int32), _scalar(0, tl.int32)
    for start in range(0, V, 4 * BQ):
        offs = start + offs0
        logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        bad = tl.maximum(bad, _bad_logits(logits))
        best, best_idx = _keep_best(best, best_idx, logits, offs, V)
    return best_idx, bad | (best == float("-inf")).to(tl.int32)


@triton.jit
def _mark_support(bitmap_ptr, idx_ptr, K, W, V, enabled, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """Zero this row's bitmap of the sparse support, then set one bit per index in [0, V).

    Disabled rows use zero limits (a scalar flag in a block mask trips the interpreter).
    """
    W, K = tl.where(enabled, W, 0), tl.where(enabled, K, 0)
    words = tl.arange(0, BLOCK_W)
    for start in range(0, W, BLOCK_W):
        tl.store(bitmap_ptr + start + words, tl.zeros_like(words), mask=start + words < W)
    tl.debug_barrier()
    kk = tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + kk, mask=kk < K, other=-1)
    ok = (idx >= 0) & (idx < V)
    idx = tl.where(ok, idx, 0).to(tl.int32)
    tl.atomic_or(bitmap_ptr + idx // 32, tl.full([BLOCK_K], 1, tl.int32) << (idx % 32), mask=ok)
    tl.debug_barrier()


@triton.jit
def _race_pass(row_ptr, V, inv_t, theta, seed, pos, exclude, need_softmax, need_race, bitmap_ptr,
               Q_MODE: tl.constexpr, HAS_THETA: tl.constexpr, BQ: tl.constexpr):
    """One pass: softmax max/sum (if need_softmax); the race over p, minus a sparse q's support if exclude."""
    offs0 = tl.arange(0, BQ)[:, None] * 4 + tl.arange(0, 4)[None, :]
    m, s = _scalar(float("-inf"), tl.float32), _scalar(0.0, tl.float32)
    best, best_idx, bad = _scalar(float("-inf"), tl.float32), _scalar(0, tl.int32), _scalar(0, tl.int32)
    for start in range(0, V, 4 * BQ):
        offs = start + offs0
        in_vocab = offs < V
        logits = tl.load(row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        bad = tl.maximum(bad, _bad_logits(logits))
        z = logits * inv_t
        if HAS_THETA:
            z = tl.where(z >= theta, z, float("-inf"))
        if need_softmax:
            m_new = tl.maximum(m, tl.max(tl.max(z, 1), 0))
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            terms = tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
            s = s * alpha + tl.sum(tl.sum(terms, 1), 0)
            m = m_new
        if need_race:
            u = _tile_uniforms(seed, pos, start, BQ)
            key = z - tl.log(-tl.log(u))
            if Q_MODE == 2:
                word = tl.load(bitmap_ptr + offs // 32, mask=offs < tl.where(exclude, V, 0), other=0,
                               cache_modifier=".cg")
                key = tl.where(((word >> (offs % 32)) & 1) != 0, float("-inf"), key)
            best, best_idx = _keep_best(best, best_idx, key, offs, V)
    return m, s, best, best_idx, bad


@triton.jit
def _dense_residual_pass(row_ptr, q_row_ptr, V, inv_t, theta, m, inv_s, seed, pos,
                         HAS_THETA: tl.constexpr, BQ: tl.constexpr):
    """Race over max(0, p - q) / E; the best key stays 0 when the residual has no mass."""
    offs0 = tl.arange(0, BQ)[:, None] * 4 + tl.arange(0, 4)[None, :]
    best, best_idx, bad = _scalar(0.0, tl.float32), _scalar(0, tl.int32), _scalar(0, tl.int32)
    for start in range(0, V, 4 * BQ):
        offs = start + offs0
        in_vocab = offs < V
        z = tl.load(row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32) * inv_t
        if HAS_THETA:
            z = tl.where(z >= theta, z, float("-inf"))
        q = tl.load(q_row_ptr + offs, mask=in_vocab, other=0.0)
        bad = tl.maximum(bad, tl.max(tl.max((~(q >= 0) | (q == float("inf"))).to(tl.int32), 1), 0))
        residual = tl.maximum(tl.exp(z - m) * inv_s - q, 0.0)
        key = residual / -tl.log(_tile_uniforms(seed, pos, start, BQ))
        best, best_idx = _keep_best(best, best_idx, key, offs, V)
    return best, best_idx, bad


@triton.jit
def _rejection_kernel(
    logits_ptr, stride_logits, draft_ids_ptr, cu_drafts_ptr, row_request_ptr,
    q_ptr, stride_q, q_idx_ptr, stride_q_idx, bitmap_ptr, stride_bitmap,
    temperature_ptr, seed_ptr, positions_ptr, theta_ptr, rate_ptr, scratch_ptr, out_ptr, stride_out,
    V, K, W, out_width,
    Q_MODE: tl.constexpr, HAS_THETA: tl.constexpr, HAS_RATE: tl.constexpr,
    BQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, MAX_ROWS: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.load(row_request_ptr + r)
    first_draft = tl.load(cu_drafts_ptr + b)
    k_b = (tl.load(cu_drafts_ptr + b + 1) - first_draft).to(tl.int32)
    j = (r - first_draft - b).to(tl.int32)
    has_draft = j < k_b
    d = first_draft + j
    x = tl.load(draft_ids_ptr + d, mask=has_draft, other=-1)
    valid = has_draft & (x >= 0) & (x < V)
    x_safe = tl.where(valid, x, 0)
    seed = tl.load(seed_ptr + b)
    pos = (tl.load(positions_ptr + b) + j).to(tl.int32)  # low word of the position, as the reference
    u_accept = tl.max(_philox_uniforms(seed, tl.zeros([1], tl.int32), pos, STREAM_ACCEPT)[0], 0)
    rate = 0.0
    if HAS_RATE:
        rate = tl.load(rate_ptr + j, mask=has_draft, other=0.0)
    row_ptr = logits_ptr + r.to(tl.int64) * stride_logits
    temperature = tl.load(temperature_ptr + b)

    if temperature == 0.0:
        argmax, bad = _argmax_pass(row_ptr, V, BQ)
        accept = valid & ((u_accept < rate) if HAS_RATE else (x == argmax))
        token = tl.where(accept, x, argmax.to(tl.int64))
    else:
        inv_t = tl.math.div_rn(1.0, temperature)
        theta = float("-inf")
        if HAS_THETA:
            theta = tl.load(theta_ptr + r)
        bitmap_row = bitmap_ptr + d * stride_bitmap
        if Q_MODE == 2:
            _mark_support(bitmap_row, q_idx_ptr + d * stride_q_idx, K, W, V, valid, BLOCK_K, BLOCK_W)
        # One-hot q needs no softmax; a checked draft row of a dense q races only in the residual pass.
        need_softmax = valid & (Q_MODE != 0)
        need_race = (valid == 0) if Q_MODE == 1 else (valid | True)
        m, s, best, best_idx, bad = _race_pass(row_ptr, V, inv_t, theta, seed, pos, valid, need_softmax,
                                               need_race, bitmap_row, Q_MODE, HAS_THETA, BQ)
        bad = bad | (tl.maximum(m, best) == float("-inf")).to(tl.int32)
        if Q_MODE == 0:  # the race winner is the row's token; the draft passes iff it won
            accept = valid & ((u_accept < rate) if HAS_RATE else (x == best_idx))
            token = tl.where(accept, x, best_idx.to(tl.int64))
        else:
            inv_s = tl.math.div_rn(1.0, s)
            z_x = tl.load(row_ptr + x_safe).to(tl.float32) * inv_t
            if HAS_THETA:
                z_x = tl.where(z_x >= theta, z_x, float("-inf"))
            p_x = tl.exp(z_x - m) * inv_s
            q_x = 1.0
            if Q_MODE == 1:
                q_x = tl.load(q_ptr + d * stride_q + x_safe, mask=valid, other=0.0)
                bad = bad | (valid & (~(q_x >= 0) | (q_x == float("inf")))).to(tl.int32)
            if Q_MODE == 2:
                kk = tl.arange(0, BLOCK_K)
                idx = tl.load(q_idx_ptr + d * stride_q_idx + kk, mask=kk < tl.where(valid, K, 0), other=-1)
                in_vocab = (idx >= 0) & (idx < V)
                val = tl.load(q_ptr + d * stride_q + kk, mask=in_vocab, other=0.0)
                bad = bad | tl.max((in_vocab & (~(val >= 0) | (val == float("inf")))).to(tl.int32), 0)
                q_x = tl.sum(tl.where(in_vocab & (idx == x), val, 0.0), 0)
                # The support re-enters the race with residual keys, on the scale of the log-space keys.
                idx_c = tl.where(in_vocab, idx, 0).to(tl.int32)
                z_s = tl.load(row_ptr + idx_c, mask=in_vocab, other=float("-inf")).to(tl.float32) * inv_t
                if HAS_THETA:
                    z_s = tl.where(z_s >= theta, z_s, float("-inf"))
                residual = tl.maximum(tl.exp(z_s - m) * inv_s - val, 0.0)
                e_s = -tl.log(_entry_uniforms(seed, pos, idx_c))
                key_s = m + tl.log(s) + tl.log(residual) - tl.log(e_s)
                key_s = tl.where(in_vocab, key_s, float("-inf"))
                best_s = tl.max(key_s, 0)
                idx_s = tl.min(tl.where(key_s == best_s, idx_c, V), 0)
                take_s = (best_s > best) | ((best_s == best) & (idx_s < best_idx) & (best_s > float("-inf")))
                best, best_idx = tl.where(take_s, best_s, best), tl.where(take_s, idx_s, best_idx)
            accept = valid & ((u_accept < rate) if HAS_RATE else (u_accept * q_x < p_x))
            recovered, empty = best_idx.to(tl.int64), best == float("-inf")
            if Q_MODE == 1:  # noqa: SIM102 (a constexpr and a runtime condition cannot share one Triton `if`)
                if valid & (accept == 0):
                    best, best_idx, q_bad = _dense_residual_pass(row_ptr, q_ptr + d * stride_q, V, inv_t,
                                                                 theta, m, inv_s, seed, pos, HAS_THETA, BQ)
                    recovered, empty = best_idx.to(tl.int64), best == 0.0
                    bad = bad | q_bad
            if valid & (accept == 0) & empty:  # rounding left the residual no mass: sample from p (rare)
                _m, _s, _best, p_idx, _bad = _race_pass(row_ptr, V, inv_t, theta, seed, pos, False, False,
                                                        True, bitmap_row, Q_MODE, HAS_THETA, BQ)
                recovered = p_idx.to(tl.int64)
            token = tl.where(accept, x, recovered)

    # Scratch (int32, zeroed): each row's token, its state (bit 0 accepted, bit 1 bad input), the tickets.
    R = tl.num_programs(0)
    row_token_ptr, row_state_ptr, ticket_ptr = scratch_ptr, scratch_ptr + R, scratch_ptr + 2 * R
    tl.store(row_token_ptr + r, token.to(tl.int32))
    tl.store(row_state_ptr + r, accept.to(tl.int32) | ((bad != 0).to(tl.int32) << 1))
    # Last row of the request to get here assembles the output (release: the stores above; acquire: theirs).
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + b, 1)
    if ticket == k_b:
        tl.debug_barrier()
        jj = tl.arange(0, MAX_ROWS)
        first_row = first_draft + b
        live = jj <= k_b
        state = tl.load(row_state_ptr + first_row + jj, mask=live, other=0, cache_modifier=".cg")
        first_reject = tl.min(tl.where(live & ((state & 1) == 0), jj, MAX_ROWS), 0)
        any_bad = tl.max(state >> 1, 0)
        toks = tl.load(row_token_ptr + first_row + jj, mask=jj <= first_reject, other=-1,
                       cache_modifier=".cg")
        out_row = out_ptr + b * stride_out
        tl.store(out_row + 1 + jj, toks.to(tl.int64), mask=jj < out_width)
        tl.store(out_row, tl.where(any_bad != 0, -1, first_reject + 1).to(tl.int64))


def _padded(t: torch.Tensor, fill: float) -> torch.Tensor:
    """Sparse q [D, K] widened to at least 16 columns (-1 indices: unused slots), so that q of any width up
    to 16 passes the kernel the same K and strides: one compiled kernel rather than one per width."""
    width = max(16, triton.next_power_of_2(t.shape[1]))
    if t.shape[1] == width:
        return t
    out = t.new_full((t.shape[0], width), fill)
    out[:, :t.shape[1]] = t
    return out


def _block_quads(vocab_size: int) -> int:
    """Quads (4 vocab entries) per tile: up to 2048 entries a tile."""
    return min(512, triton.next_power_of_2(triton.cdiv(vocab_size, 4)))


@functools.cache
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32, int64 and int32 stand-ins for pointer arguments a batch does not use (never read)."""
    dtypes = (torch.float32, torch.long, torch.int32)
    return tuple(torch.zeros(1, dtype=dtype, device=device) for dtype in dtypes)


def launch(batch: SamplerBatch) -> SampleOutput:
    """Enqueue the kernel; bad input shows as count -1 in the output. Nothing here waits for the device."""
    logits = batch.logits if batch.logits.stride(-1) == 1 else batch.logits.contiguous()
    R, V = logits.shape
    B = batch.cu_drafts.numel() - 1
    device = logits.device
    packed = torch.empty((B, batch.max_drafts + 2), dtype=torch.long, device=device)
    if B == 0:
        return SampleOutput(packed)
    none_f, none_i64, none_i32 = _placeholders(device)
    q = batch.draft_probs
    q_vals, q_idx, bitmap, K, W, mode = none_f, none_i64, none_i32, 1, 1, Q_ONE_HOT
    if q is not None and q.is_dense:
        q_vals, mode = q.probs, Q_DENSE
    elif q is not None:
        q_vals, q_idx, mode = _padded(q.values, 0.0), _padded(q.indices, -1), Q_SPARSE
        K, W = q_idx.shape[1], triton.cdiv(V, 32)
        bitmap = torch.empty((q_idx.shape[0], W), dtype=torch.int32, device=device)
    draft_ids = batch.draft_ids if batch.draft_ids.numel() > 0 else none_i64
    theta = batch.thresholds if batch.thresholds is not None else none_f
    rate = batch.synthetic if batch.synthetic is not None else none_f
    scratch = torch.zeros(2 * R + B, dtype=torch.int32, device=device)
    _rejection_kernel[(R,)](
        logits, logits.stride(0), draft_ids, batch.cu_drafts, batch.row_request,
        q_vals, q_vals.stride(0), q_idx, q_idx.stride(0), bitmap, bitmap.stride(0),
        batch.temperature, batch.seed, batch.positions, theta, rate, scratch, packed, packed.stride(0),
        V, K, W, batch.max_drafts + 1,
        Q_MODE=mode, HAS_THETA=batch.thresholds is not None, HAS_RATE=batch.synthetic is not None,
        # Block sizes rounded up to a floor, so that every k <= 7 and every q width <= 16 share one compiled
        # kernel (each new one is a Triton compile: a stall of a second in the middle of serving).
        BQ=_block_quads(V), BLOCK_K=max(16, triton.next_power_of_2(K)),
        BLOCK_W=min(1024, triton.next_power_of_2(W)),
        MAX_ROWS=max(8, triton.next_power_of_2(batch.max_drafts + 1)), num_warps=8 if V >= 8192 else 4,
        enable_fp_fusion=False,  # no FMA contraction: the same roundings as the reference
    )
    return SampleOutput(packed)
