"""ops.follow_sampler in one launch: each row of a verification's inputs continues where a sampler left it.

As the torch reference (ops.follow_sampler_ref), which is seven launches and about 0.14 ms of host time a
round on an H100 host (bench/results/session43/): ids[b, 0] = the last token the sampler emitted for row b,
positions[b] += how many it emitted, both clamped so that a row the sampler marked bad feeds a valid id.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _follow_kernel(ids_ptr, stride_ids, positions_ptr, packed_ptr, stride_packed, width, vocab_size):
    b = tl.program_id(0).to(tl.int64)
    row = packed_ptr + b * stride_packed
    count = tl.minimum(tl.maximum(tl.load(row), 1), width - 1)  # packed[b]: count, then the tokens
    token = tl.minimum(tl.maximum(tl.load(row + count), 0), vocab_size - 1)
    tl.store(ids_ptr + b * stride_ids, token.to(ids_ptr.dtype.element_ty))
    position = tl.load(positions_ptr + b)
    tl.store(positions_ptr + b, position + count.to(position.dtype))


def follow(ids: torch.Tensor, positions: torch.Tensor, packed: torch.Tensor, vocab_size: int) -> None:
    """ids [>= B, T], positions [>= B], packed [B, 2 + k], on one device; queued, nothing waited for."""
    rows, width = packed.shape
    if rows:
        _follow_kernel[(rows,)](ids, ids.stride(0), positions, packed, packed.stride(0), width, vocab_size)
