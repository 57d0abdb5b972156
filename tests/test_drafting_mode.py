"""The adaptive verifier's choice between tables and serial drafting (verifier_service/drafting_mode.py):
measured epochs, the faster mode kept, the other tried again every `explore_every`-th epoch."""

import pytest
from specwire.verifier.drafting_mode import DraftingMode


def run_epoch(d: DraftingMode, tokens_per_round: int, seconds_per_round: float, clock: list[float],
              requests: int = 1) -> str:
    """One epoch of rounds for `requests` requests in d's mode; returns the mode it ran in."""
    mode = d.mode
    for _ in range(d.epoch_rounds):
        clock[0] += seconds_per_round
        d.record(tokens_per_round, requests, clock[0])
    return mode


def test_tables_first_then_serial_then_the_faster_with_exploration():
    d, clock = DraftingMode(epoch_rounds=4, explore_every=3), [0.0]
    d.record(0, 1, clock[0])  # the first round only starts the clock
    speed = {"tables": (16, 0.010), "serial": (30, 0.012)}  # serial: 2,500 tok/s against 1,600
    modes = [run_epoch(d, *speed[d.mode], clock) for _ in range(8)]
    assert modes[:2] == ["tables", "serial"]  # each measured once
    assert d.rate == pytest.approx({"tables": 1600.0, "serial": 2500.0})
    # Epochs 3..8: serial, except the one after every third epoch, which tries tables again.
    assert modes[2:] == ["tables" if n % 3 == 0 else "serial" for n in range(2, 8)]


def test_a_mode_that_got_faster_is_taken_back():
    d, clock = DraftingMode(epoch_rounds=2, explore_every=3), [0.0]
    d.record(0, 1, clock[0])
    run_epoch(d, 10, 0.01, clock)  # tables: 1,000 tok/s
    run_epoch(d, 20, 0.01, clock)  # serial: 2,000 tok/s
    assert d.mode == "serial"
    while d.mode == "serial":  # until the exploration epoch
        run_epoch(d, 20, 0.01, clock)
    run_epoch(d, 50, 0.01, clock)  # tables now measure 5,000 tok/s: their estimate becomes 3,000
    assert d.rate["tables"] == pytest.approx(3000.0) and d.mode == "tables"


def test_a_draining_batch_is_judged_per_request():
    """Tables measured on a full batch of 16, serial on its tail of 4: serial settles fewer tokens a second
    (4 x 2.5 / 10 ms = 1,000 against 16 x 1.6 / 10 ms = 2,560) but more per request (250 against 160), and
    that is what its mode is worth."""
    d, clock = DraftingMode(epoch_rounds=4, explore_every=3), [0.0]
    d.record(0, 16, clock[0])
    run_epoch(d, 16 * 1.6, 0.010, clock, requests=16)  # tables
    run_epoch(d, 4 * 2.5, 0.010, clock, requests=4)  # serial
    assert d.rate == pytest.approx({"tables": 160.0, "serial": 250.0})
    assert d.mode == "serial"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="epoch_rounds"):
        DraftingMode(epoch_rounds=0)
