"""The speculation cache's wait for a late table: (tau - 1) x the last verification's time, tau the moving
mean acceptance length of rounds with drafts (a wait pays while tau / (t + w) > 1 / t), never below half a
verification, and a configured table_wait wins."""

from types import SimpleNamespace

import pytest
from specwire.verifier.scheduler import Scheduler, SchedulerConfig

from specwire.metrics import VerifierMetrics


def scheduler(table_wait: float | None = None) -> Scheduler:
    """A Scheduler with only what the wait rule and the round bookkeeping read (no engine is needed)."""
    s = Scheduler.__new__(Scheduler)
    s.config, s.metrics = SchedulerConfig(table_wait=table_wait), VerifierMetrics()
    s._tau, s._verify_seconds = 2.0, 0.004
    return s


def finish(s: Scheduler, num_drafts: list[int], accepted: list[int]) -> None:
    live = [SimpleNamespace(drafts=0, draft_tokens=0, accepted_tokens=0) for _ in num_drafts]
    s._finish_round(live, num_drafts, [[7] * (a + 1) for a in accepted], [])


def test_the_wait_follows_acceptance():
    s = scheduler()
    assert s._table_wait() == pytest.approx(0.004)  # tau starts at 2: one verification
    for _ in range(200):  # every drafted row accepts 3 of 4 drafts: tau -> 4
        finish(s, [4, 4, 0], [3, 3, 0])  # the undrafted row does not count
    assert s._tau == pytest.approx(4.0, abs=1e-3)
    assert s._table_wait() == pytest.approx(3 * 0.004, rel=1e-3)
    for _ in range(200):  # nothing accepted: tau -> 1, and the wait is half a verification
        finish(s, [4], [0])
    assert s._table_wait() == pytest.approx(0.002)
    for _ in range(50):  # rounds without drafts leave tau alone
        finish(s, [0, 0], [0, 0])
    assert s._table_wait() == pytest.approx(0.002)


def test_a_configured_wait_wins():
    s = scheduler(table_wait=0.03)
    finish(s, [4], [4])
    assert s._table_wait() == 0.03
