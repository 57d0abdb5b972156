"""The chain's round starts (drafter_service.chain_visits) against rounds played out one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specwire.drafter.chain_visits import (
    anchor_acceptance,
    chain_metrics,
    chain_sums,
    visits,
)

K = 4


def response_mask(B: int, T: int, rng: np.random.Generator) -> torch.Tensor:
    """Rows whose response anchors run from a prompt length to a row length, one row empty."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B - 1):
        start = int(rng.integers(0, T // 3))
        mask[b, start : int(rng.integers(start + 1, T + 1))] = True
    return mask


def play(accept: np.ndarray, mask: np.ndarray, rng: np.random.Generator | None) -> tuple[np.ndarray, list]:
    """Round starts [B, T] (0 / 1) and accepted drafts of each whole round, one round after another: each
    draft accepted when it is a hit (rng None, accept 0 / 1) or with probability accept."""
    k, B, T = accept.shape
    starts, rounds = np.zeros((B, T)), []
    for b in range(B):
        anchors = np.flatnonzero(mask[b])
        if not len(anchors):
            continue
        i, last = anchors[0], anchors[-1]
        while i <= last:
            starts[b, i] = 1
            m = 0
            while m < k and i + m <= last:
                chance = accept[m, b, i]
                if not (chance >= 1 if rng is None else rng.random() < chance):
                    break
                m += 1
            if i + k - 1 <= last:
                rounds.append(m)
            i += m + 1
    return starts, rounds


def test_anchor_acceptance_aligns_each_step_on_its_anchor():
    per_step = [torch.arange(6.0).expand(2, 6) + 10 * j for j in range(3)]
    out = anchor_acceptance(per_step, 4)
    assert out.shape == (4, 2, 6)
    assert out[0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert out[2, 1].tolist() == [22, 23, 24, 25, 0, 0]  # anchor i's step 2 sits at index i + 2
    assert not out[3].any()  # steps not given: never accepted


def test_greedy_visits_are_the_rounds_played_out():
    rng = np.random.default_rng(0)
    B, T = 7, 60
    mask = response_mask(B, T, rng)
    accept = torch.from_numpy((rng.random((K, B, T)) < 0.6).astype(np.float64))
    visit, _ = visits(accept, mask)
    starts, rounds = play(accept.numpy(), mask.numpy(), None)
    assert torch.equal(visit, torch.from_numpy(starts))
    metrics = chain_metrics(chain_sums(accept, mask))
    assert metrics["rounds"] == len(rounds)
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + np.mean(rounds), abs=1e-3)
    for j, rate in enumerate(metrics["acceptance_per_position"]):
        assert rate == pytest.approx(np.mean([m > j for m in rounds]), abs=1e-4)


def test_sampled_visits_are_the_chance_of_a_round_start():
    """Fractional acceptance: the visit chances and the chain's yield against 20,000 played-out texts."""
    rng = np.random.default_rng(1)
    B, T = 3, 40
    mask = response_mask(B, T, rng)
    accept = torch.from_numpy(rng.uniform(0.2, 0.95, (K, B, T)))
    visit, _ = visits(accept, mask)
    sums = chain_sums(accept, mask)
    n = 20_000
    freq, rounds = np.zeros((B, T)), []
    for _ in range(n):
        starts, played = play(accept.numpy(), mask.numpy(), rng)
        freq += starts
        rounds += played
    freq /= n
    # a start frequency is a mean of n Bernoulli draws: 5 standard errors
    tolerance = 5 * np.sqrt(np.maximum(visit.numpy() * (1 - visit.numpy()), 1e-4) / n)
    assert np.all(np.abs(freq - visit.numpy()) <= tolerance)
    assert sums["rounds"] == pytest.approx(len(rounds) / n, rel=0.01)
    length = chain_metrics(sums)["mean_acceptance_length"]
    assert length == pytest.approx(1 + np.mean(rounds), abs=5 * np.std(rounds) / np.sqrt(len(rounds)) + 1e-3)
