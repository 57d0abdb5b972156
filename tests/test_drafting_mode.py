"""The adaptive verifier's choice between tables, serial drafting and rounds without drafts
(verifier_service/drafting_mode.py): measured epochs, the fastest mode kept, the others tried again at gaps
that double while they keep losing."""

import pytest
from specwire.verifier.drafting_mode import DraftingMode


def run_epoch(d: DraftingMode, tokens_per_round: int, seconds_per_round: float, requests: int = 1) -> str:
    """One epoch of rounds for `requests` requests in d's mode; returns the mode it ran in."""
    mode = d.mode
    for _ in range(d.epoch_rounds):
        d.record(tokens_per_round, requests, seconds_per_round)
    return mode


def test_each_mode_once_then_the_fastest_with_the_others_retried_ever_less_often():
    d = DraftingMode(epoch_rounds=4, explore_every=3, max_gap=12)
    # serial: 2,500 tok/s against tables' 1,600 and none's 1,250
    speed = {"tables": (16, 0.010), "serial": (30, 0.012), "none": (10, 0.008)}
    modes = [run_epoch(d, *speed[d.mode]) for _ in range(40)]
    assert modes[:3] == ["tables", "serial", "none"]  # each measured once
    assert d.rate == pytest.approx({"tables": 1600.0, "serial": 2500.0, "none": 1250.0})
    # A loser is retried 3 epochs after it last ran, then after 6, 12, and 12 again (max_gap); serial runs
    # the rest.
    assert [i for i, m in enumerate(modes) if m == "tables"] == [0, 3, 9, 21, 33]
    assert [i for i, m in enumerate(modes) if m == "none"] == [2, 5, 11, 23, 35]
    assert modes.count("serial") == 40 - 10


def test_a_mode_that_keeps_losing_costs_about_one_epoch_in_max_gap():
    d = DraftingMode(epoch_rounds=2, explore_every=8, max_gap=64)
    speed = {"tables": (7, 0.010), "serial": (10, 0.020), "none": (9, 0.010)}
    modes = [run_epoch(d, *speed[d.mode]) for _ in range(1000)]
    retries = sum(m != "none" for m in modes[200:])  # in the steady state: each loser once in 65 epochs
    assert 2 * 800 / 65 - 2 <= retries <= 2 * 800 / 65 + 2


def test_a_mode_that_got_faster_is_taken_back():
    d = DraftingMode(epoch_rounds=2, explore_every=3)
    run_epoch(d, 10, 0.01)  # tables: 1,000 tok/s
    run_epoch(d, 20, 0.01)  # serial: 2,000 tok/s
    run_epoch(d, 5, 0.01)  # none: 500 tok/s
    assert d.mode == "tables"  # the first retry, 3 epochs after its measurement
    run_epoch(d, 50, 0.01)  # tables now measure 5,000 tok/s: their estimate becomes 3,000
    assert d.rate["tables"] == pytest.approx(3000.0)
    speed = {"tables": 50, "serial": 20, "none": 5}
    modes = [run_epoch(d, speed[d.mode], 0.01) for _ in range(8)]
    assert modes == ["serial", "none", "tables", "tables", "tables", "tables", "serial", "none"]


def test_a_loser_that_becomes_the_fastest_is_found_within_max_gap():
    """Long after it settled on rounds without drafts (the gaps at their longest), the load changes and the
    tables become the fastest: the next retry finds them, within max_gap epochs, and they are kept."""
    d = DraftingMode(epoch_rounds=2, explore_every=4, max_gap=16)
    slow = {"tables": (7, 0.010), "serial": (10, 0.020), "none": (9, 0.010)}
    for _ in range(200):
        run_epoch(d, *slow[d.mode])
    fast = {**slow, "tables": (20, 0.010)}
    modes = [run_epoch(d, *fast[d.mode]) for _ in range(40)]
    first = modes.index("tables")
    after = modes[first + 1:]  # the tables, but for the others' retries (none's gap starts short again)
    assert first <= 16 and after.count("tables") >= 0.8 * len(after)


def test_where_no_drafting_pays_rounds_without_drafts_are_kept():
    """Sampled requests across two processes (session 29): tables 0.7x, serial 0.5x of target-only; rounds
    without drafts lose only the link's overhead."""
    d = DraftingMode(epoch_rounds=4, explore_every=8)
    speed = {"tables": (7, 0.010), "serial": (10, 0.020), "none": (9, 0.010)}
    modes = [run_epoch(d, *speed[d.mode]) for _ in range(8)]
    assert modes == ["tables", "serial", "none", "none", "none", "none", "none", "none"]
    assert run_epoch(d, *speed[d.mode]) == "tables"  # the 9th epoch explores


def test_a_draining_batch_is_judged_per_request():
    """Tables measured on a full batch of 16, serial on its tail of 4: serial settles fewer tokens a second
    (4 x 2.5 / 10 ms = 1,000 against 16 x 1.6 / 10 ms = 2,560) but more per request (250 against 160), and
    that is what its mode is worth."""
    d = DraftingMode(epoch_rounds=4, explore_every=8)
    run_epoch(d, 16 * 1.6, 0.010, requests=16)  # tables
    run_epoch(d, 4 * 2.5, 0.010, requests=4)  # serial
    run_epoch(d, 4 * 1.0, 0.010, requests=4)  # none
    assert d.rate == pytest.approx({"tables": 160.0, "serial": 250.0, "none": 100.0})
    assert d.mode == "serial"


def test_the_round_that_pays_the_switch_is_not_measured():
    """After rounds without drafts the drafter catches up on their tokens in the next epoch's first round
    (slow, and without drafts): that is the switch's cost, not the mode's, and would keep every mode but
    "none" from being taken back."""
    d = DraftingMode(epoch_rounds=4, explore_every=8)
    speed = {"tables": (16, 0.010), "serial": (30, 0.012), "none": (10, 0.008)}
    for mode, (tokens, seconds) in speed.items():
        assert d.mode == mode
        d.record(1, 1, 0.100)  # the switch
        for _ in range(d.epoch_rounds - 1):
            d.record(tokens, 1, seconds)
    assert d.rate == pytest.approx({"tables": 1600.0, "serial": 2500.0, "none": 1250.0})
    assert d.mode == "serial"
    one = DraftingMode(epoch_rounds=1)  # epochs of one round: that round is all there is to measure
    one.record(10, 1, 0.01)
    assert one.rate["tables"] == pytest.approx(1000.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="epoch_rounds"):
        DraftingMode(epoch_rounds=0)
    with pytest.raises(ValueError, match="max_gap"):
        DraftingMode(epoch_rounds=4, explore_every=8, max_gap=4)


def test_a_subset_of_modes_starts_with_its_first_and_never_runs_the_others():
    """Where serial drafts queue (drafting_mode.QUEUED_MODES) the tables take no part."""
    d = DraftingMode(epoch_rounds=2, explore_every=3, modes=("serial", "none"))
    speed = {"serial": (30, 0.012), "none": (10, 0.008)}
    modes = [run_epoch(d, *speed[d.mode]) for _ in range(12)]
    assert modes[:2] == ["serial", "none"] and set(modes) == {"serial", "none"}
    assert set(d.rate) == {"serial", "none"} and modes.count("serial") > modes.count("none")


@pytest.mark.parametrize("modes", [(), ("serial", "serial"), ("serial", "fast")])
def test_modes_must_be_distinct_known_ones(modes):
    with pytest.raises(ValueError, match="modes must be distinct"):
        DraftingMode(epoch_rounds=2, modes=modes)
