"""Rejection sampling for speculative decoding: the verifier's entry point, the same on CPU and CUDA.

`rejection_sample` validates the batch, computes top-k/top-p thresholds (only for rows that filter), and
runs the Triton kernel on CUDA or the PyTorch reference elsewhere. Semantics: rejection_sampler_ref.

Small per-request tensors (num_drafts, temperature, top_k, top_p, seed, positions) are best passed on the
CPU: they are validated there and copied over without a device sync. The launcher syncs once at the end,
to raise on NaN/inf inputs.
"""

import os
from typing import Literal

import torch
from specwire.kernels.rejection_sampler_ref import (
    DraftProbs,
    SampleOutput,
    SamplerBatch,
    SamplerInputError,
    logit_thresholds,
    row_layout,
    sample_ref,
)

try:  # CPU-only installs may lack Triton; they run the reference.
    from specwire.kernels.rejection_sampler_triton import sample_triton
except ImportError:
    sample_triton = None

__all__ = ["DraftProbs", "SampleOutput", "SamplerInputError", "prepare_batch", "rejection_sample"]

Backend = Literal["auto", "triton", "torch"]


def _per_request(name: str, t: torch.Tensor, B: int, dtype: torch.dtype) -> torch.Tensor:
    if t.shape != (B,):
        raise SamplerInputError(f"{name} has shape {tuple(t.shape)}, expected ({B},)")
    return t.detach().cpu().to(dtype)


def _fail_if(mask: torch.Tensor, message: str, values: torch.Tensor) -> None:
    if bool(mask.any()):
        raise SamplerInputError(f"{message}: {values[mask][:8].tolist()}")


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
    usable = sample_triton is not None and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
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
) -> SampleOutput:
    """Accept a prefix of each request's drafts and add one token, preserving the target distribution.

    target_logits [sum(k_b + 1), V] (rows of request b: its k_b drafts, then the bonus position);
    draft_token_ids [sum k_b]; num_drafts [B]; draft_probs None means one-hot (greedy) drafts;
    temperature [B] (0 = greedy), top_k [B] (0 = off), top_p [B] in (0, 1], seed [B] int64, positions [B]
    (absolute position of each request's first sampled token; the randomness is a function of seed and
    position only). synthetic_acceptance [>= max k] replaces the acceptance test by per-position rates.
    Target-only sampling is every num_drafts = 0. Returns tokens [B, max_k + 1] (-1 padded) and
    num_tokens [B] = accepted + 1.
    """
    batch = prepare_batch(target_logits, draft_token_ids, num_drafts, draft_probs, temperature, top_k, top_p,
                          seed, positions, synthetic_acceptance)
    if not _pick_backend(backend, target_logits):
        return sample_ref(batch)
    if target_logits.is_cuda:
        with torch.cuda.device(target_logits.device):  # Triton launches on the *current* device
            return sample_triton(batch)
    return sample_triton(batch)  # the Triton interpreter, on CPU tensors


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
    """Validate the arguments of rejection_sample and move them to the logits' device."""
    if target_logits.dim() != 2 or not target_logits.dtype.is_floating_point:
        raise SamplerInputError(f"target_logits must be a 2-D float tensor, got {target_logits.dtype} "
                                f"{list(target_logits.shape)}")
    R, V = target_logits.shape
    device = target_logits.device
    if num_drafts.dim() != 1:
        raise SamplerInputError(f"num_drafts must be 1-D, got shape {list(num_drafts.shape)}")
    B = num_drafts.numel()
    nd = num_drafts.detach().cpu().long()
    _fail_if(nd < 0, "num_drafts must be >= 0", nd)
    D = int(nd.sum())
    if R != D + B:
        raise SamplerInputError(f"target_logits has {R} rows, expected sum(num_drafts + 1) = {D + B}")
    if draft_token_ids.shape != (D,) or draft_token_ids.dtype.is_floating_point:
        raise SamplerInputError(f"draft_token_ids must be integer [{D}], got {draft_token_ids.dtype} "
                                f"{list(draft_token_ids.shape)}")
    _check_draft_probs(draft_probs, D, V)

    temp = _per_request("temperature", temperature, B, torch.float32)
    _fail_if(~(temp >= 0) | (temp == float("inf")), "temperature must be finite and >= 0", temp)
    k = _per_request("top_k", top_k, B, torch.long)
    _fail_if(k < 0, "top_k must be >= 0", k)
    p = _per_request("top_p", top_p, B, torch.float32)
    _fail_if(~((p > 0) & (p <= 1)), "top_p must be in (0, 1]", p)
    seeds = _per_request("seed", seed, B, torch.long)
    pos = _per_request("positions", positions, B, torch.long)
    _fail_if((pos < 0) | (pos + nd >= 2**32), "positions must be in [0, 2**32 - max k)", pos)
    max_drafts = int(nd.max()) if B > 0 else 0
    rates = None
    if synthetic_acceptance is not None:
        rates = synthetic_acceptance.detach().cpu().float()
        if rates.dim() != 1 or rates.numel() < max(max_drafts, 1):
            raise SamplerInputError(f"synthetic_acceptance must be 1-D with >= {max(max_drafts, 1)} rates, "
                                    f"got shape {list(rates.shape)}")
        _fail_if(~((rates >= 0) & (rates <= 1)), "synthetic_acceptance rates must be in [0, 1]", rates)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    request = to_device(row_layout(nd, R).request)
    temp, k, p, seeds, pos, nd = map(to_device, (temp, k, p, seeds, pos, nd))
    if draft_probs is not None:
        draft_probs = DraftProbs(*(to_device(t) if t is not None else None
                                   for t in (draft_probs.probs, draft_probs.indices, draft_probs.values)))
    return SamplerBatch(
        logits=target_logits, draft_ids=to_device(draft_token_ids.long()), num_drafts=nd,
        max_drafts=max_drafts,
        draft_probs=draft_probs if D > 0 else None, temperature=temp, top_k=k, top_p=p, seed=seeds,
        positions=pos, synthetic=to_device(rates) if rates is not None else None,
        thresholds=logit_thresholds(target_logits, request, temp, k, p),
    )
