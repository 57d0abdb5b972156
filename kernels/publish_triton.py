"""Drafts handed to another GPU only if a flag on this one says so, then a number written behind them.

A drafter with tables ahead learns on its GPU, not its host, whether every request's outcome was in its
table; only then may the tables' drafts go into the verifier's buffer and the step's number into the slot
its GPU waits on, both before the serial drafting (which runs all the same). A stream memory write
(stream_values.write_value) cannot be made conditional, so one program does it: the copy, a barrier, then
the number by an atomic exchange with release semantics at system scope, which makes the copy visible to
any reader that sees the number.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _publish_kernel(src_ptr, dst_ptr, numel, flag_ptr, slot_ptr, value, BLOCK: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        for start in range(0, numel, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < numel
            tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=inside), mask=inside)
        tl.debug_barrier()
        tl.atomic_xchg(slot_ptr, value, sem="release", scope="sys")


class Address:
    """A raw device address (a mapped host slot) passed to a kernel as an int64 pointer."""

    dtype = torch.int64

    def __init__(self, address: int):
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def publish_if(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor, slot: torch.Tensor | Address,
               value: int) -> None:
    """Queued on the current stream: if flag (a bool or integer scalar on this device) is set, src's
    values into dst's first cells (both contiguous, same dtype; dst may be another GPU's memory mapped
    here) and then `value` into slot (an int64 cell: a tensor, or a mapped host address)."""
    numel = src.numel()
    if dst.numel() < numel or dst.dtype != src.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"publish_if: {numel} {src.dtype} values into {dst.numel()} {dst.dtype} cells "
                         "(both contiguous)")
    _publish_kernel[(1,)](src, dst, numel, flag, slot, value, BLOCK=1024)
