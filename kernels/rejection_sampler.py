"""Rejection sampling for speculative decoding: the verifier's entry point, the same on CPU and CUDA.

`rejection_sample` validates the batch on the host, computes top-k/top-p thresholds (only for rows that
filter), and runs the Triton kernel on CUDA or the PyTorch reference elsewhere. Semantics:
rejection_sampler_ref.

The small per-request columns (num_drafts, temperature, top_k, top_p, seed, positions: tensors or numpy
arrays) must be on the CPU: they are validated there, and everything the device needs from the host (those
columns, the row layout, and draft ids or draft probs given on the host) travels in one copy from pinned
memory. On CUDA nothing
waits for the device except the final bad-input check; with defer_check=True not even that, and
SampleOutput.token_lists() reads the result and raises on bad input with one device-to-host copy.
"""

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from specwire.kernels.rejection_sampler_ref import (
    DraftProbs,
    SampleOutput,
    SamplerBatch,
    SamplerInputError,
    logit_thresholds,
    sample_ref,
)

from specwire import round_trace
from specwire.staging import TORCH_DTYPES, HostArray, host_array

try:  # CPU-only installs may lack Triton; they run the reference.
    from specwire.kernels.rejection_sampler_triton import launch
except ImportError:
    launch = None

__all__ = ["DraftProbs", "SampleOutput", "SamplerColumns", "SamplerInputError", "batch_with", "prepare_batch",
           "prepare_columns", "rejection_sample", "sample_with", "warm_up"]

Backend = Literal["auto", "triton", "torch"]

HostColumn = HostArray  # a per-request column, or the draft ids, on the host


def _column(name: str, t: HostColumn, B: int, dtype: type) -> np.ndarray:
    if tuple(t.shape) != (B,):
        raise SamplerInputError(f"{name} has shape {tuple(t.shape)}, expected ({B},)")
    return host_array(t).astype(dtype, copy=False)


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


@dataclass(frozen=True)
class SamplerColumns:
    """A batch's per-request columns, validated and on the device: all that holds from round to round while
    the batch keeps its rows and their draft counts (prepare_columns)."""

    num_drafts: tuple[int, ...]
    vocab_size: int
    device: torch.device
    cu_drafts: torch.Tensor  # [B + 1] int64
    row_request: torch.Tensor  # [R] int64
    temperature: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    synthetic: torch.Tensor | None
    filters: list[torch.Tensor]  # logit_thresholds' row arguments; empty: no row filters


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: HostColumn,
    num_drafts: HostColumn,
    draft_probs: DraftProbs | None,
    temperature: HostColumn,
    top_k: HostColumn,
    top_p: HostColumn,
    seed: HostColumn,
    positions: HostColumn,
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
    return _sample(batch, backend, defer_check)


def sample_with(
    columns: SamplerColumns,
    target_logits: torch.Tensor,
    draft_token_ids: HostColumn,
    draft_probs: DraftProbs | None,
    positions: HostColumn,
    backend: Backend = "auto",
    defer_check: bool = False,
) -> SampleOutput:
    """rejection_sample with the per-request columns prepared already (prepare_columns): a serving loop
    whose batch keeps its rows and draft counts from round to round builds them once, and each round moves
    only its drafts and positions."""
    return _sample(batch_with(columns, target_logits, draft_token_ids, draft_probs, positions), backend,
                   defer_check)


def _sample(batch: SamplerBatch, backend: Backend, defer_check: bool) -> SampleOutput:
    round_trace.mark("s.prepared")
    if not _pick_backend(backend, batch.logits):
        return sample_ref(batch)
    with torch.cuda.device(batch.logits.device) if batch.logits.is_cuda else contextlib.nullcontext():
        out = launch(batch)  # Triton launches on the *current* device; on CPU this is the interpreter
    if not defer_check:
        out.check()
    return out


def prepare_batch(
    target_logits: torch.Tensor,
    draft_token_ids: HostColumn,
    num_drafts: HostColumn,
    draft_probs: DraftProbs | None,
    temperature: HostColumn,
    top_k: HostColumn,
    top_p: HostColumn,
    seed: HostColumn,
    positions: HostColumn,
    synthetic_acceptance: torch.Tensor | None = None,
) -> SamplerBatch:
    """Validate the arguments of rejection_sample on the host and move them to the logits' device."""
    _check_logits(target_logits)
    columns = prepare_columns(num_drafts, temperature, top_k, top_p, seed, target_logits.shape[1],
                              target_logits.device, synthetic_acceptance)
    return batch_with(columns, target_logits, draft_token_ids, draft_probs, positions)


def prepare_columns(
    num_drafts: HostColumn,
    temperature: HostColumn,
    top_k: HostColumn,
    top_p: HostColumn,
    seed: HostColumn,
    vocab_size: int,
    device: torch.device,
    synthetic_acceptance: torch.Tensor | None = None,
) -> SamplerColumns:
    """Validate rejection_sample's per-request columns on the host and move them to `device`. The host side
    works in numpy: a torch call on a tiny CPU tensor costs several microseconds and a release and retake of
    the GIL, which a serving loop beside busy threads pays each time."""
    if num_drafts.ndim != 1:
        raise SamplerInputError(f"num_drafts must be 1-D, got shape {list(num_drafts.shape)}")
    B, V = num_drafts.shape[0], vocab_size
    nd = host_array(num_drafts).astype(np.int64)
    ks = nd.tolist()
    _fail_if_any("num_drafts must be >= 0", [k for k in ks if k < 0])
    temp = _column("temperature", temperature, B, np.float32)
    top_k, top_p = _column("top_k", top_k, B, np.int64), _column("top_p", top_p, B, np.float32)
    seed = _column("seed", seed, B, np.int64)
    temps, top_ks, top_ps = temp.tolist(), top_k.tolist(), top_p.tolist()
    _fail_if_any("temperature must be finite and >= 0", [t for t in temps if not 0 <= t < math.inf])
    _fail_if_any("top_k must be >= 0", [k for k in top_ks if k < 0])
    _fail_if_any("top_p must be in (0, 1]", [p for p in top_ps if not 0 < p <= 1])
    max_drafts = max(ks, default=0)
    rates = None
    if synthetic_acceptance is not None:
        rates = synthetic_acceptance.detach().cpu().float().numpy()
        if rates.ndim != 1 or rates.size < max(max_drafts, 1):
            raise SamplerInputError(f"synthetic_acceptance must be 1-D with >= {max(max_drafts, 1)} rates, "
                                    f"got shape {list(rates.shape)}")
        _fail_if_any("synthetic_acceptance rates must be in [0, 1]",
                     [r for r in rates.tolist() if not 0 <= r <= 1])

    cu_drafts = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(nd, out=cu_drafts[1:])
    row_request = np.repeat(np.arange(B, dtype=np.int64), nd + 1)
    filtering = [t > 0 and (0 < k < V or p < 1) for t, k, p in zip(temps, top_ks, top_ps, strict=True)]
    # Decided on the host, so a batch that does not filter never waits for the device.
    filters = _filter_columns(filtering, row_request, temp, top_k, top_p, V) if any(filtering) else []
    moved = _to_device([cu_drafts, row_request, temp, seed, rates, *filters], torch.device(device))
    return SamplerColumns(tuple(ks), V, torch.device(device), *moved[:5], moved[5:])


def batch_with(columns: SamplerColumns, target_logits: torch.Tensor, draft_token_ids: HostColumn,
               draft_probs: DraftProbs | None, positions: HostColumn) -> SamplerBatch:
    """The round's SamplerBatch: `columns` (prepare_columns, for these logits' device and vocabulary) with
    the round's logits, drafts and positions, checked against them and moved to the device."""
    _check_logits(target_logits)
    R, V = target_logits.shape
    if columns.vocab_size != V or columns.device != target_logits.device:
        raise SamplerInputError(f"the columns were prepared for {columns.vocab_size} logits on "
                                f"{columns.device}, got {V} on {target_logits.device}")
    ks = columns.num_drafts
    B, D = len(ks), sum(ks)
    if R != D + B:
        raise SamplerInputError(f"target_logits has {R} rows, expected sum(num_drafts + 1) = {D + B}")
    if tuple(draft_token_ids.shape) != (D,) or _is_float(draft_token_ids):
        raise SamplerInputError(f"draft_token_ids must be integer [{D}], got {draft_token_ids.dtype} "
                                f"{list(draft_token_ids.shape)}")
    _check_draft_probs(draft_probs, D, V)
    pos = _column("positions", positions, B, np.int64)
    _fail_if_any("positions must be in [0, 2**32 - max k)",
                 [p for p, k in zip(pos.tolist(), ks, strict=True) if not 0 <= p < 2**32 - k])
    q = None if draft_probs is None or D == 0 else (
        draft_probs.probs, None if draft_probs.is_dense else draft_probs.indices.long(), draft_probs.values)
    ids = draft_token_ids.long() if isinstance(draft_token_ids, torch.Tensor) else \
        draft_token_ids.astype(np.int64, copy=False)
    moved = _to_device([ids, pos, *(q or ())], target_logits.device)
    return SamplerBatch(
        logits=target_logits, draft_ids=moved[0], cu_drafts=columns.cu_drafts,
        row_request=columns.row_request, max_drafts=max(ks, default=0),
        draft_probs=DraftProbs(*moved[2:5]) if q else None,
        temperature=columns.temperature, seed=columns.seed, positions=moved[1], synthetic=columns.synthetic,
        thresholds=logit_thresholds(target_logits, *columns.filters) if columns.filters else None,
    )


def _check_logits(target_logits: torch.Tensor) -> None:
    if target_logits.dim() != 2 or not target_logits.dtype.is_floating_point:
        raise SamplerInputError(f"target_logits must be a 2-D float tensor, got {target_logits.dtype} "
                                f"{list(target_logits.shape)}")


def _is_float(t: HostColumn) -> bool:
    return t.dtype.kind == "f" if isinstance(t, np.ndarray) else t.dtype.is_floating_point


def _filter_columns(filtering: list[bool], row_request: np.ndarray, temperature: np.ndarray,
                    top_k: np.ndarray, top_p: np.ndarray, V: int) -> list[np.ndarray]:
    """logit_thresholds' per-row arguments, on the host: the rows that filter, their 1 / temperature,
    top-k in [1, V] and top-p."""
    rows = np.flatnonzero(np.asarray(filtering)[row_request])
    req = row_request[rows]
    return [rows, np.float32(1.0) / temperature[req], np.where(top_k > 0, np.minimum(top_k, V), V)[req],
            top_p[req]]


def _to_device(parts: list[torch.Tensor | np.ndarray | None], device: torch.device
               ) -> list[torch.Tensor | None]:
    """The parts as tensors on `device`. To CUDA, those on the host travel together: one copy from pinned
    memory, filled through numpy."""
    moved: list = list(parts)
    host = []
    for i, t in enumerate(parts):
        on_host = isinstance(t, np.ndarray) or (t is not None and t.device.type == "cpu")
        if t is None or (not on_host and t.device == device):
            continue
        if device.type == "cuda" and on_host:
            host.append(i)
        else:
            moved[i] = (torch.from_numpy(t) if isinstance(t, np.ndarray) else t).to(device)
    if not host:
        return moved
    arrays = [np.ascontiguousarray(host_array(parts[i])) for i in host]
    # Every part starts 16-byte aligned: Triton compiles a kernel per pattern of pointer alignments, and
    # offsets that moved with the batch's shape would make a new pattern (a compile) out of a new batch.
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // 16) * 16
    staging = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    block = staging.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        block[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    for i, a, offset in zip(host, arrays, offsets, strict=True):
        moved[i] = on_device[offset:offset + a.nbytes].view(TORCH_DTYPES[a.dtype]).view(a.shape)
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
