"""EAGLE-3's reduced draft vocabulary: the tokens the target writes most, in the published d2t / t2d format.

The head's logits range over draft ids 0..N-1 and draft id d stands for target id d + d2t[d] (d2t holds
offsets, as SafeAILab EAGLE, SpecForge, vLLM and SGLang store it); t2d is a boolean mask over the target
vocabulary. The drafter's q lives on the target vocabulary and is zero outside the draft one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F


def choose_draft_vocab(token_lists: Iterable[Iterable[int]], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent target ids in token_lists (ties: the smaller id), ascending; padded with the
    smallest unseen ids when fewer distinct tokens occur."""
    counts: Counter = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    ranked += [t for t in range(vocab) if t not in chosen][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def coverage(token_lists: Iterable[Iterable[int]], draft_to_target: torch.Tensor, vocab: int) -> float:
    """Share of the tokens in token_lists that the draft vocabulary contains."""
    inside = t2d_mask(draft_to_target, vocab)
    total = hit = 0
    for tokens in token_lists:
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        total += ids.numel()
        hit += int(inside[ids].sum())
    return hit / max(total, 1)


def d2t_offsets(draft_to_target: torch.Tensor) -> torch.Tensor:
    """The published d2t: target id minus draft id."""
    return draft_to_target - torch.arange(draft_to_target.numel(), device=draft_to_target.device)


def t2d_mask(draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """The published t2d: True at the target ids the draft vocabulary holds."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=draft_to_target.device)
    mask[draft_to_target] = True
    return mask


def restricted_log_probs(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, draft_to_target: torch.Tensor
) -> torch.Tensor:
    """The target's distribution restricted to the draft vocabulary and renormalised, as float32
    log-probabilities [..., N] (the soft target of the draft head's forward KL), from the target's final
    hidden states [..., H]: only the draft vocabulary's rows of the output layer are computed (N of V)."""
    return torch.log_softmax(F.linear(hidden, lm_head_weight[draft_to_target]).float(), dim=-1)


def inside_mass(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, draft_to_target: torch.Tensor, rows: int = 4096
) -> torch.Tensor:
    """The share of the target's full next-token distribution that lies on the draft vocabulary, float32
    [...], from its final hidden states [..., H]: no draft can be accepted on the rest, so a sampled draft's
    chance of acceptance is sum min(mass x restricted p, q). Computed `rows` positions at a time, so the full
    [positions, V] logits never exist at once."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    parts = []
    for chunk in flat.split(rows):
        logits = F.linear(chunk, lm_head_weight).float()
        parts.append((torch.logsumexp(logits[:, draft_to_target], -1) - torch.logsumexp(logits, -1)).exp())
    return torch.cat(parts).reshape(hidden.shape[:-1])


def target_argmax(hidden: torch.Tensor, lm_head_weight: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """The target's greedy token on its full vocabulary [...] from its final hidden states [..., H] (a draft
    is accepted at T = 0 only if it is this token, which may lie off the draft vocabulary), `rows` at once."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens = torch.cat([F.linear(chunk, lm_head_weight).argmax(-1) for chunk in flat.split(rows)])
    return tokens.reshape(hidden.shape[:-1])
