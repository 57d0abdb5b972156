"""RMSNorm and fused residual-add + RMSNorm in one Triton launch (one program per row)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, w_ptr, out_ptr, residual_out_ptr, stride_x, stride_r, hidden, eps,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum is rounded to the model dtype first, as the eager model's `x + residual` is.
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # HF order: normalise in float32, round to the input dtype, then scale.
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    if w.shape != (hidden,):
        raise ValueError(f"rms_norm weight shape {tuple(w.shape)} does not match hidden size {hidden}")
    x_rows = _rows(x)
    r_rows = _rows(residual) if residual is not None else x_rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, r_rows, w.contiguous(), out, residual_out, x_rows.stride(0), r_rows.stride(0), hidden, eps,
        BLOCK=block, ADD_RESIDUAL=residual is not None, num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, w, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match x shape {tuple(x.shape)}")
    return _launch(x, residual, w, eps)
