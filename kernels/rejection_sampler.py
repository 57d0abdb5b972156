"""Rejection sampling for speculative decoding: the verifier's entry point, the same on CPU and CUDA.

`rejection_sample` validates the batch on the host, computes top-k/top-p thresholds (only for rows that
filter), and runs the Triton kernel on CUDA or the PyTorch reference elsewhere. Semantics:
rejection_sampler_ref.

The small per-request tensors (num_drafts, temperature, top_k, top_p, seed, positions) must be on the CPU:
they are validated there, and everything the device needs from the host (those columns, the row layout,
and draft ids or draft probs given on the host) travels in one copy from pinned memory. On CUDA nothing
waits for the device except the final bad-input check; with defer_check=True not even that, and
SampleOutput.token_lists() reads the result and raises on bad input with one device-to-host copy.
"""

import contextlib
import math
import os
from typing import Literal

import torch
from specwire.kernels.rejection_sampler_ref import (
    DraftProbs,
    SampleOutput,
    SamplerBatch,
    SamplerInputError,
    logit_thresholds,
    sample_ref,
)

try:  # CPU-only installs may lack Triton; they run the reference.
    from specwire.kernels.rejection_sampler_triton import launch
except ImportError:
    launch = None

__all__ = ["DraftProbs", "SampleOutput", "SamplerInputError", "prepare_batch", "rejection_sample", "warm_up"]

Backend = Literal["auto", "triton", "torch"]


def _column(name: str, t: torch.Tensor, B: int, dtype: torch.dtype) -> torch.Tensor:
    if t.shape != (B,):
        raise SamplerInputError(f"{name} has shape {tuple(t.shape)}, expected ({B},)")
    return t.detach().cpu().to(dtype)


def _fail_if_any(message: str, bad_values: list) -> None:
    if bad_values:
        raise SamplerInputError(f"{message}: {bad_values[:8]}")


def _check_draft_probs(draft_probs: DraftProbs | None, D: int, V: int) -> None:
    if draft_probs is None:
        return
    if draft_probs.is_dense:
        probs = draft_probs.probs
        if probs.shape != (D, V) or probs.dtype != torch.float32:
            raise SamplerInputError(f"dense draft_probs must be float32 [{D}, {V}], got {probs.dtype} "
                                    f"{list(probs.shape)}")
        return
    idx, val = draft_probs.indices, draft_probs.values
    if idx is None or val is None:
        raise SamplerInputError("DraftProbs needs probs (dense) or indices and values (sparse)")
    if idx.dim() != 2 or idx.shape[0] != D or val.shape != idx.shape or val.dtype != torch.float32:
        raise SamplerInputError(f"sparse draft_probs must be indices and float32 values of shape [{D}, K], "
                                f"got {list(idx.shape)} and {val.dtype} {list(val.shape)}")
    if idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise SamplerInputError(f"sparse draft_probs indices must be integers, got {idx.dtype}")


def _pick_backend(backend: Backend, logits: torch.Tensor) -> bool:
    """True to run the Triton kernel."""
    if backend not in ("auto", "triton", "torch"):
        raise SamplerInputError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    usable = launch is not None and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "triton" and not usable:
        raise SamplerInputError("backend='triton' needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    return usable and (logits.is_cuda or backend == "triton")


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: DraftProbs | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    synthetic_acceptance: torch.Tensor | None = None,
    backend: Backend = "auto",
    defer_check: bool = False,
) -> SampleOutput:
    """Accept a prefix of each request's drafts and add one token, preserving the target distribution.

    target_logits [sum(k_b + 1), V] (rows of request b: its k_b drafts, then the bonus position);
    draft_token_ids [sum k_b] (host or device); num_drafts [B]; draft_probs None means one-hot (greedy)
    drafts; temperature [B] (0 = greedy), top_k [B] (0 = off), top_p [B] in (0, 1], seed [B] int64,
    positions [B] (absolute position of each request's first sampled token; the randomness is a function of
    seed and position only). synthetic_acceptance [>= max k] replaces the acceptance test by per-position
    rates. Target-only sampling is every num_drafts = 0. Returns tokens [B, max_k + 1] (-1 padded) and
    num_tokens [B] = accepted + 1, packed so that out.token_lists() reads them with one copy.

    Bad arguments raise SamplerInputError here. NaN/inf logits or draft probs raise here too, which on CUDA
    waits for the kernel; with defer_check=True the kernel's path leaves that to out.token_lists() (or
    out.check()), so the call never waits for the device. The reference (CPU) always raises here.
    """
    batch = prepare_batch(target_logits, draft_token_ids, num_drafts, draft_probs, temperature, top_k, top_p,
                          seed, positions, synthetic_acceptance)
    if not _pick_backend(backend, target_logits):
        return sample_ref(batch)
    with torch.cuda.device(target_logits.device) if target_logits.is_cuda else contextlib.nullcontext():
        out = launch(batch)  # Triton launches on the *current* device; on CPU this is the interpreter
    if not defer_check:
        out.check()
    return out


def prepare_batch(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: DraftProbs | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    synthetic_acceptance: torch.Tensor | None = None,
) -> SamplerBatch:
    """Validate the arguments of rejection_sample on the host and move them to the logits' device."""
    if target_logits.dim() != 2 or not target_logits.dtype.is_floating_point:
        raise SamplerInputError(f"target_logits must be a 2-D float tensor, got {target_logits.dtype} "
                                f"{list(target_logits.shape)}")
    R, V = target_logits.shape
    if num_drafts.dim() != 1:
        raise SamplerInputError(f"num_drafts must be 1-D, got shape {list(num_drafts.shape)}")
    B = num_drafts.numel()
    nd = num_drafts.detach().cpu().long()
    ks = nd.tolist()
    _fail_if_any("num_drafts must be >= 0", [k for k in ks if k < 0])
    D = sum(ks)
    if R != D + B:
        raise SamplerInputError(f"target_logits has {R} rows, expected sum(num_drafts + 1) = {D + B}")
    if draft_token_ids.shape != (D,) or draft_token_ids.dtype.is_floating_point:
        raise SamplerInputError(f"draft_token_ids must be integer [{D}], got {draft_token_ids.dtype} "
                                f"{list(draft_token_ids.shape)}")
    _check_draft_probs(draft_probs, D, V)

    temp = _column("temperature", temperature, B, torch.float32)
    top_k, top_p = _column("top_k", top_k, B, torch.long), _column("top_p", top_p, B, torch.float32)
    seed, pos = _column("seed", seed, B, torch.long), _column("positions", positions, B, torch.long)
    temps, top_ks, top_ps = temp.tolist(), top_k.tolist(), top_p.tolist()
    _fail_if_any("temperature must be finite and >= 0", [t for t in temps if not 0 <= t < math.inf])
    _fail_if_any("top_k must be >= 0", [k for k in top_ks if k < 0])
    _fail_if_any("top_p must be in (0, 1]", [p for p in top_ps if not 0 < p <= 1])
    _fail_if_any("positions must be in [0, 2**32 - max k)",
                 [p for p, k in zip(pos.tolist(), ks, strict=True) if not 0 <= p < 2**32 - k])
    max_drafts = max(ks, default=0)
    rates = None
    if synthetic_acceptance is not None:
        rates = synthetic_acceptance.detach().cpu().float()
        if rates.dim() != 1 or rates.numel() < max(max_drafts, 1):
            raise SamplerInputError(f"synthetic_acceptance must be 1-D with >= {max(max_drafts, 1)} rates, "
                                    f"got shape {list(rates.shape)}")
        _fail_if_any("synthetic_acceptance rates must be in [0, 1]",
                     [r for r in rates.tolist() if not 0 <= r <= 1])

    cu_drafts = torch.zeros(B + 1, dtype=torch.long)
    torch.cumsum(nd, 0, out=cu_drafts[1:])
    row_request = torch.repeat_interleave(torch.arange(B), nd + 1, output_size=R)
    filtering = [t > 0 and (0 < k < V or p < 1) for t, k, p in zip(temps, top_ks, top_ps, strict=True)]
    # Decided on the host, so a batch that does not filter never waits for the device.
    filters = _filter_columns(filtering, row_request, temp, top_k, top_p, V) if any(filtering) else []
    q = None if draft_probs is None or D == 0 else (
        draft_probs.probs, None if draft_probs.is_dense else draft_probs.indices.long(), draft_probs.values)
    moved = _to_device([draft_token_ids.long(), cu_drafts, row_request, temp, seed, pos, rates,
                        *(q or ()), *filters], target_logits.device)
    draft_ids, cu_drafts, row_request, temp, seed, pos, rates = moved[:7]
    return SamplerBatch(
        logits=target_logits, draft_ids=draft_ids, cu_drafts=cu_drafts, row_request=row_request,
        max_drafts=max_drafts, draft_probs=DraftProbs(*moved[7:10]) if q else None, temperature=temp,
        seed=seed, positions=pos, synthetic=rates,
        thresholds=logit_thresholds(target_logits, *moved[-4:]) if filters else None,
    )


def _filter_columns(filtering: list[bool], row_request: torch.Tensor, temperature: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor, V: int) -> list[torch.Tensor]:
    """logit_thresholds' per-row arguments, on the host: the rows that filter, their 1 / temperature,
    top-k in [1, V] and top-p."""
    rows = torch.nonzero(torch.tensor(filtering)[row_request]).squeeze(1)
    req = row_request[rows]
    return [rows, 1.0 / temperature[req], torch.where(top_k > 0, top_k.clamp(max=V), V)[req], top_p[req]]


def _to_device(parts: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """The parts on `device`. To CUDA, those on the host travel together: one copy from pinned memory."""
    moved, host = list(parts), []
    for i, t in enumerate(parts):
        if t is not None and t.device != device:
            if device.type == "cuda" and t.device.type == "cpu":
                host.append(i)
            else:
                moved[i] = t.to(device)
    if not host:
        return moved
    # Every part starts 16-byte aligned: Triton compiles a kernel per pattern of pointer alignments, and
    # offsets that moved with the batch's shape would make a new pattern (a compile) out of a new batch.
    pieces = []
    for i in host:
        f = parts[i].reshape(-1)
        if f.stride(0) != 1:  # a column of a table (one element long: is_contiguous() but stride != 1)
            f = torch.empty(f.numel(), dtype=f.dtype).copy_(f)
        f = f.view(torch.uint8)
        pieces += [f, torch.zeros(-f.numel() % 16, dtype=torch.uint8)]
    staging = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8, pin_memory=True)
    torch.cat(pieces, out=staging)
    chunks = staging.to(device, non_blocking=True).split([p.numel() for p in pieces])[::2]
    for i, chunk in zip(host, chunks, strict=True):
        moved[i] = chunk.view(parts[i].dtype).view(parts[i].shape)
    return moved


def warm_up(device: torch.device, vocab_size: int, max_drafts: int,
            synthetic_acceptance: torch.Tensor | None = None, q_width: int = 16) -> int:
    """Runs the kernel once for each variant a server meets, so that Triton compiles them all now rather than
    while a request waits: decode and verify steps; one-hot drafts (greedy and seeded requests) and sparse
    top-K q of one and of q_width entries; with and without top-k filtering. Returns the number of calls
    made (0 off CUDA or without Triton, where nothing is compiled)."""
    if device.type != "cuda" or launch is None:
        return 0
    V, B, calls = vocab_size, 2, 0
    for k in sorted({0, max_drafts}):
        for width in (None,) if k == 0 else (None, 1, min(q_width, V)):
            for top_k in (0, 8):
                D = B * k
                probs = None
                if width is not None:
                    values = torch.full((D, width), 1.0 / width)
                    probs = DraftProbs.sparse(torch.arange(width).repeat(D, 1), values)
                out = rejection_sample(
                    torch.randn(B * (k + 1), V, device=device), torch.zeros(D, dtype=torch.long),
                    torch.full((B,), k, dtype=torch.int32), probs, torch.ones(B), torch.full((B,), top_k),
                    torch.ones(B), torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                    synthetic_acceptance=synthetic_acceptance)
                out.token_lists()
                calls += 1
    return calls
