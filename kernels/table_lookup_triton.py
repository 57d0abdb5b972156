"""table_lookup.look_up in one Triton program: the lookup, then, when every request hit, the drafts into the
verifier's buffer (another GPU's memory, mapped here) and the step's number into its slot (host memory
mapped for this GPU) by an atomic exchange with release semantics at system scope, after a barrier, so that
any reader that sees the number sees the drafts. A stream memory write (stream_values.write_value) cannot
be made to depend on what the device found, so the program writes the number itself.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rate", "value", "B"])  # (one program for every batch and step number)
def _look_up_kernel(settled_ptr, settled_stride, settled_width, rows_ptr, first_ptr,
                    slots_ptr, score_ptr, accepted_ptr, bonus_ptr, tokens_ptr, draws_ptr, rate,
                    hit_index_ptr, drafts_ptr, all_hit_ptr, dst_ptr, slot_ptr, value, B, trash,
                    N: tl.constexpr, K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, FORCED: tl.constexpr, PUBLISH: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    live = b < B
    row = tl.load(rows_ptr + b, mask=live, other=0)
    count = tl.load(settled_ptr + row * settled_stride, mask=live, other=-1)
    column = tl.minimum(tl.maximum(count, 1), settled_width - 1)
    bonus = tl.load(settled_ptr + row * settled_stride + column, mask=live, other=-1)
    first = tl.load(first_ptr + b, mask=live, other=-1)
    n = tl.arange(0, BLOCK_N)
    valid = live[:, None] & (first >= 0)[:, None] & (n < N)[None, :]
    cells = tl.where(valid, first[:, None] + n[None, :], 0)
    held = valid & (tl.load(slots_ptr + cells, mask=valid, other=trash) != trash)
    held = held & (tl.load(score_ptr + cells, mask=valid, other=0.0) > 0)
    same = held & (tl.load(accepted_ptr + cells, mask=valid, other=-1) == (count - 1)[:, None])
    found = same & (tl.load(bonus_ptr + cells, mask=valid, other=-1) == bonus[:, None])
    first_found = tl.min(tl.where(found, n[None, :], BLOCK_N), axis=1)  # BLOCK_N: none
    first_same = tl.min(tl.where(same, n[None, :], BLOCK_N), axis=1)
    hit = first_found < BLOCK_N
    if FORCED:
        draw = tl.load(draws_ptr + b, mask=live, other=1.0)
        hit = hit | ((first_same < BLOCK_N) & (draw < rate))
    pick = tl.where(first_found < BLOCK_N, first_found, tl.where(first_same < BLOCK_N, first_same, 0))
    tl.store(hit_index_ptr + b, tl.where(hit, pick, -1).to(tl.int64), mask=live)
    all_hit = tl.sum(tl.where(live & (hit == 0), 1, 0), axis=0) == 0
    tl.store(all_hit_ptr, all_hit.to(tl.int32))
    k = tl.arange(0, BLOCK_K)
    inside = live[:, None] & (k < K)[None, :]
    cell = tl.maximum(first, 0) + pick
    drafts = tl.load(tokens_ptr + cell[:, None] * K + k[None, :], mask=inside, other=0)
    tl.store(drafts_ptr + b[:, None] * K + k[None, :], drafts, mask=inside)
    if PUBLISH:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if all_hit:
            tl.store(dst_ptr + b[:, None] * K + k[None, :], drafts, mask=inside)
            tl.debug_barrier()
            tl.atomic_xchg(slot_ptr, value, sem="release", scope="sys")


def look_up(settled, rows, first, table, draws, rate, out, publish) -> None:
    """As table_lookup.look_up_ref (arguments the same), queued on the current stream. One compiled program
    serves every batch up to out.hit_index's length (rows past B are masked off)."""
    B, K = first.shape[0], table.tokens.shape[1]
    if B == 0:
        return
    if not (settled.is_contiguous() and table.tokens.is_contiguous() and out.drafts.stride(0) == K):
        raise ValueError("look_up: the settled rows, the branches' drafts and the output need rows of K")
    dst, slot, value = publish if publish is not None else (out.drafts, out.all_hit, 0)
    _look_up_kernel[(1,)](
        settled, settled.stride(0), settled.shape[1], rows, first, table.slots, table.score, table.accepted,
        table.bonus, table.tokens, draws if draws is not None else table.score, float(rate), out.hit_index,
        out.drafts, out.all_hit, dst, slot, value, B, table.trash, N=table.num_branches, K=K,
        BLOCK_B=triton.next_power_of_2(out.hit_index.shape[0]),
        BLOCK_N=triton.next_power_of_2(table.num_branches), BLOCK_K=triton.next_power_of_2(K),
        FORCED=draws is not None, PUBLISH=publish is not None)
