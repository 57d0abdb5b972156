"""Draft-token sampling with static shapes and no host syncs, so it runs inside a CUDA graph.

Per row: greedy (temperature 0), or a sample from q = softmax(logits / T), optionally truncated to the top-K
logits and renormalised. q is what the verifier needs for lossless rejection sampling, so it is returned
exactly as sampled from: `top_q` over `top_idx` for truncated (and greedy, one-hot) rows, `full_q` over the
whole vocabulary for untruncated rows. All probabilities are float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftSample(NamedTuple):
    tokens: torch.Tensor  # [B] int64, draft-vocabulary ids
    top_idx: torch.Tensor | None  # [B, K] int64, the K largest logits, descending
    top_q: torch.Tensor | None  # [B, K] float32: truncated q (0 past the row's top_k; one-hot at 0 if greedy)
    full_q: torch.Tensor | None  # [B, V] float32: untruncated q at the row's temperature


def sample_drafts(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, max_top_k: int, mode: str = "full"
) -> DraftSample:
    """logits [B, V] float32, temperature [B] (0 = greedy), top_k [B] (0 = no truncation, else <= max_top_k).

    mode is what the batch needs, so a CUDA graph per mode skips the rest: "greedy" (argmax only; no q),
    "top_k" (every sampled row truncates; full_q is None) or "full". Sampling is an exponential race:
    argmax(q / E) with E ~ Exp(1) picks i with probability q_i.
    """
    if mode == "greedy":
        return DraftSample(logits.argmax(-1), None, None, None)
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp_min(1e-6))[:, None]
    top_logits, top_idx = logits.topk(max_top_k, dim=-1)
    width = max_top_k if mode == "top_k" else logits.shape[-1]
    noise = torch.empty_like(logits[:, :width]).exponential_().clamp_min_(1e-20)

    columns = torch.arange(max_top_k, device=logits.device)
    kept = columns[None, :] < top_k[:, None]
    top_q = torch.softmax((top_logits * inv_t).masked_fill(~kept, float("-inf")), dim=-1).nan_to_num_(0.0)
    top_pick = top_idx.gather(1, (top_q / noise[:, :max_top_k]).argmax(-1, keepdim=True))[:, 0]
    one_hot = (columns == 0).float().expand_as(top_q)
    top_q = torch.where(greedy[:, None], one_hot, top_q)
    if mode == "top_k":
        return DraftSample(torch.where(greedy, top_idx[:, 0], top_pick), top_idx, top_q, None)

    full_q = torch.softmax(logits * inv_t, dim=-1)
    full_pick = (full_q / noise).argmax(-1)
    tokens = torch.where(greedy, top_idx[:, 0], torch.where(top_k > 0, top_pick, full_pick))
    return DraftSample(tokens, top_idx, top_q, full_q)
