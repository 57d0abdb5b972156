"""Forced acceptance for benchmarks: per-position rates for the rejection sampler's `synthetic_acceptance`
that give a requested mean acceptance length, whatever the drafts are.

The sampler accepts draft j (1-based) of a round with probability r_j given that drafts 1..j-1 were accepted,
and a round emits its accepted drafts plus one token. With the same rate r at every position and k drafts,

    E[tokens per round] = 1 + r + r^2 + ... + r^k = (1 - r^(k+1)) / (1 - r)          (k + 1 at r = 1)

which is vLLM's mean acceptance length (1 + accepted / drafts). It rises monotonically from 1 (r = 0) to
k + 1 (r = 1), so one r gives any length in [1, k + 1]; forced_rate finds it by bisection. A constant
conditional rate is also what a real head shows: the shipped head's per-position acceptance at k = 4,
0.68 / 0.46 / 0.32 / 0.23, is 0.68 / 0.68 / 0.70 / 0.72 given the previous position's acceptance.

Output in this mode is not the target's: accepted drafts are kept whatever they are. It measures speed only.
"""

from __future__ import annotations

import functools

import torch


def mean_acceptance_length(rate: float, k: int) -> float:
    """Expected tokens per round with k drafts, each accepted with `rate` given the ones before it."""
    return sum(rate**i for i in range(k + 1))


def forced_rate(length: float, k: int) -> float:
    """The per-position rate r with mean_acceptance_length(r, k) == length (to 1e-12)."""
    if k < 1:
        raise ValueError(f"forced acceptance needs k >= 1 drafts, got k = {k}")
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"a forced mean acceptance length must be in [1, k + 1] = [1, {k + 1}], "
                         f"got {length}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_acceptance_length(mid, k) < length else (low, mid)
    return (low + high) / 2


def forced_rates(length: float, k: int) -> tuple[float, ...]:
    """The rejection sampler's synthetic_acceptance for k drafts: forced_rate at every position."""
    return (forced_rate(length, k),) * k


@functools.lru_cache(maxsize=8)
def rates_tensor(rates: tuple[float, ...] | None) -> torch.Tensor | None:
    """The rates as the host tensor rejection_sample takes (built once per distinct tuple), or None."""
    return None if rates is None else torch.tensor(rates, dtype=torch.float32)
