"""Where a k-draft chain starts its rounds on a given text, and what each round yields.

A round drafts k tokens from anchor i, accepts the leading ones, and the next round starts after the bonus
token: at i + m + 1 when m drafts were accepted. So rounds start right after a rejected draft far more often
than at a random position, and only those anchors count for acceptance. Given the chance a_j(i) that step j's
draft from anchor i is accepted (greedy text: 0 or 1, the draft is the target's token or not; sampled text:
sum min(p, q)), the chance that a round starts at each anchor follows by one pass over the text, and from it
the chain's expected tokens per round: the figure `specwire bench --local` measures on the same text (greedy:
exactly), which a teacher-forced average over every anchor overstates. (Weighting the training loss by these
chances, tried in session 30, changed nothing measurable.)
"""

from __future__ import annotations

import numpy as np
import torch


def anchor_acceptance(per_step: list[torch.Tensor], k: int) -> torch.Tensor:
    """[k, B, T] on the CPU: entry (j, b, i) is the acceptance of anchor i's step-j draft, per_step[j] being
    indexed by the draft's own index i + j (as drafter_service.ttt lays steps out); beyond T it is 0."""
    first = per_step[0]
    out = torch.zeros(k, *first.shape)
    for j in range(min(k, len(per_step))):
        step = per_step[j].detach().float().cpu()
        out[j, :, : first.shape[1] - j] = step[:, j:]
    return out


def drafted_anchors(response: torch.Tensor) -> torch.Tensor:
    """The anchors a drafter drafts from [B, T], of a row's response anchors (the trainer's mask: anchor i
    predicts token i + 2): all but each row's first, whose token, the response's first, the prefill writes."""
    rows = response.any(1)
    out = response.clone()
    out[torch.arange(len(out), device=out.device)[rows], response.int().argmax(1)[rows]] = False
    return out


def visits(accept: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chance that a round starts at each anchor [B, T], chance that it accepts at least j + 1 drafts
    [k, B, T]) for accept [k, B, T] (anchor_acceptance) over the anchors in mask [B, T], the response's.
    Each row starts at its first anchor; a draft past the row's last anchor is never accepted."""
    k, B, T = accept.shape
    m = mask.cpu().numpy()
    a = accept.numpy().astype(np.float64) * m[None]
    at_least = np.cumprod(a, 0)  # [k, B, T]: drafts 0..j all accepted
    before = np.concatenate([np.ones((1, B, T)), at_least])
    p = np.concatenate([before[:-1] * (1 - a), at_least[-1:]]).transpose(1, 2, 0)  # [B, T, m accepted]
    v = np.zeros((B, T + k + 1))
    has = m.any(1)
    v[np.arange(B)[has], m.argmax(1)[has]] = 1.0
    for i in range(T):  # a round at i that accepts m drafts hands the next round anchor i + m + 1
        v[:, i + 1 : i + k + 2] += (v[:, i] * m[:, i])[:, None] * p[:, i]
    return torch.from_numpy(v[:, :T] * m), torch.from_numpy(at_least)


def chain_sums(accept: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Over the rounds that fit in the text (a round's k drafts all on response anchors): their expected
    number ("rounds"), the tokens they yield ("tokens", accepted drafts + 1 each) and the drafts accepted at
    each position ("accepted_j", j = 1..k); sums, so batches add up (chain_metrics divides)."""
    k, mask = accept.shape[0], mask.cpu()
    visit, at_least = visits(accept, mask)
    whole = torch.zeros_like(mask, dtype=torch.float64)
    whole[:, : mask.shape[1] - k + 1] = mask[:, k - 1 :].double()
    start = visit * whole
    sums = {"rounds": float(start.sum()), "tokens": float(start.sum() + (start * at_least).sum())}
    return sums | {f"accepted_{j + 1}": float((start * at_least[j]).sum()) for j in range(k)}


def chain_metrics(sums: dict[str, float]) -> dict:
    """chain_sums (added up over batches) as the chain's mean acceptance length and per-position rates."""
    rounds = max(sums.get("rounds", 0.0), 1e-9)
    k = sum(key.startswith("accepted_") for key in sums)
    return {
        "mean_acceptance_length": round(sums.get("tokens", 0.0) / rounds, 3),
        "acceptance_per_position": [round(sums[f"accepted_{j}"] / rounds, 4) for j in range(1, k + 1)],
        "rounds": round(sums.get("rounds", 0.0), 1),
    }
