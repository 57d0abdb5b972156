"""The verifier's waits: for a speculation-cache table (scheduler.table_wait), waited for only when it is due
within what a hit is worth; for drafts made just in time (scheduler.just_in_time_wait), while the tokens they
add are worth more than the wait costs the whole batch."""

import asyncio

import pytest
import torch
from specwire.verifier.drafter_link import LocalDrafterLink
from specwire.verifier.scheduler import just_in_time_wait, table_wait

from specwire.metrics import VerifierMetrics
from specwire.v1 import drafter_pb2 as dpb

VERIFY = 0.006  # a verification, seconds


def test_before_any_answer_the_wait_is_half_the_budget():
    assert table_wait(VERIFY, None, 0.0, hit_rate=0.5, tau=2.0) == pytest.approx(0.5 * VERIFY * 0.5)


def test_a_table_due_within_the_budget_is_waited_for_with_a_margin():
    # budget 0.8 * 2 * 6 ms = 9.6 ms; due 1 ms after the verification ended (7 ms trip, 6 ms gone)
    assert table_wait(VERIFY, 0.007, 0.006, hit_rate=0.8, tau=3.0) == pytest.approx(0.001 + 0.25 * 0.007)


def test_the_wait_never_exceeds_what_a_hit_is_worth():
    # due in 4 ms, within the 4.8 ms budget, but the margin would pass it
    assert table_wait(VERIFY, 0.010, 0.006, hit_rate=0.8, tau=2.0) == pytest.approx(VERIFY * 0.8)


def test_a_table_due_after_the_budget_is_not_waited_for():
    # bs16 at T = 1 on two GPUs: a 21 ms round trip against a 6 ms verification
    assert table_wait(VERIFY, 0.021, 0.006, hit_rate=0.8, tau=3.0) == 0.0


def test_a_table_already_due_gets_only_the_margin():
    assert table_wait(VERIFY, 0.004, 0.006, hit_rate=0.8, tau=3.0) == pytest.approx(0.25 * 0.004)


def test_no_gain_no_wait():
    assert table_wait(VERIFY, 0.004, 0.003, hit_rate=0.0, tau=3.0) == 0.0
    assert table_wait(VERIFY, 0.004, 0.003, hit_rate=0.9, tau=1.0) == 0.0


def test_drafts_just_in_time_are_waited_for_while_their_tokens_are_worth_the_wait():
    # Batch 1: without them the round settles 1 token, with them tau: worth (tau - 1) verifications' time.
    assert just_in_time_wait(1, 1, tau=3.0, verify=VERIFY) == pytest.approx(2 * VERIFY)
    # Batch 16, 4 without drafts: they add 4 * 2 tokens to 12 * 3 + 4, so the round may grow by 8/40.
    assert just_in_time_wait(16, 4, tau=3.0, verify=VERIFY) == pytest.approx(VERIFY * 8 / 40)
    # Every request without drafts (the tables failed): as serial drafting, worth (tau - 1) / 1 of the round.
    assert just_in_time_wait(16, 16, tau=2.5, verify=VERIFY) == pytest.approx(1.5 * VERIFY)
    assert just_in_time_wait(8, 2, tau=1.0, verify=VERIFY) == 0.0  # drafts that are never accepted


def test_only_a_wait_of_the_whole_step_timeout_counts_as_a_drafter_fault():
    """A late table or just-in-time answer is the verifier's choice of a short wait (counted as late in
    specwire_spec_cache_*), not a fallback: the SpecwireDrafterFallback alert must not fire on it."""
    metrics = VerifierMetrics()
    link = LocalDrafterLink(lambda step, features: None, dpb.DrafterInfo(), lambda request: "", metrics,
                            torch.device("cpu"), step_timeout=0.02)

    async def unanswered(timeout: float | None) -> None:
        assert await link.result(asyncio.get_running_loop().create_future(), timeout=timeout) is None

    asyncio.run(unanswered(0.001))
    assert metrics.fallbacks["timeout"]._value.get() == 0
    asyncio.run(unanswered(None))
    assert metrics.fallbacks["timeout"]._value.get() == 1
