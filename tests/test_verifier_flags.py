"""The verifier's flags whose defaults follow from others: a remote drafter gets the speculation cache and the
measured drafting mode, a co-located one serial drafting; conflicts and out-of-range values are refused."""

import argparse

import pytest
from specwire.verifier.cli import check_flags
from specwire.verifier.drafting_mode import DEFAULT_EPOCH_ROUNDS

from specwire.cli import build_parser


def verifier_flags(*argv: str) -> argparse.Namespace:
    args = build_parser("verifier").parse_args(["verifier", *argv])
    check_flags(args)
    return args


@pytest.mark.parametrize("argv, cache_branches, drafting_epoch", [
    (["--drafter", "127.0.0.1:50052"], 8, DEFAULT_EPOCH_ROUNDS),  # tables, serial or none: measured
    (["--drafter", "127.0.0.1:50052", "--cache-branches", "0"], 0, 0),  # serial drafting, as asked
    (["--drafter", "127.0.0.1:50052", "--drafting-epoch", "0"], 8, 0),  # tables always, as asked
    (["--drafter", "127.0.0.1:50052", "--drafting-epoch", "32"], 8, 32),
    (["--colocated"], 0, 0),  # queued serial drafts, the co-located default
    (["--colocated", "--cache-branches", "8"], 8, 0),  # tables in-process, as asked: not measured adaptive
])
def test_drafting_defaults(argv, cache_branches, drafting_epoch):
    args = verifier_flags(*argv)
    assert (args.cache_branches, args.drafting_epoch) == (cache_branches, drafting_epoch)


def test_environment_sets_the_drafting_epoch(monkeypatch):
    monkeypatch.setenv("SPECWIRE_DRAFTING_EPOCH", "0")
    assert verifier_flags("--drafter", "127.0.0.1:50052").drafting_epoch == 0


def test_drafting_modes_are_chosen_at_connect_unless_named(monkeypatch):
    """None: the scheduler picks them when the drafter connects (serial and none where drafts queue)."""
    assert verifier_flags("--drafter", "127.0.0.1:50052").drafting_modes is None
    assert verifier_flags("--drafter", "127.0.0.1:50052", "--drafting-modes", "serial,none"
                          ).drafting_modes == ("serial", "none")
    monkeypatch.setenv("SPECWIRE_DRAFTING_MODES", "none, tables")
    assert verifier_flags("--drafter", "127.0.0.1:50052").drafting_modes == ("none", "tables")


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "127.0.0.1:50052", "--drafting-epoch", "-1"], "--drafting-epoch must be >= 0"),
    (["--drafter", "127.0.0.1:50052", "--drafting-modes", "serial,serial"], "--drafting-modes must be"),
    (["--drafter", "127.0.0.1:50052", "--drafting-modes", "tables,fast"], "--drafting-modes must be"),
    (["--drafter", "127.0.0.1:50052", "--drafting-modes", ""], "--drafting-modes must be"),
    (["--drafter", "127.0.0.1:50052", "--cache-branches", "-2"], "--cache-branches must be >= 0"),
    (["--colocated", "--drafter", "127.0.0.1:50052"], "leave out --drafter"),
])
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        verifier_flags(*argv)


def test_the_front_end_process_is_chosen_by_flag_or_environment(monkeypatch):
    assert verifier_flags().frontend == "process"
    assert verifier_flags("--frontend", "inline").frontend == "inline"
    monkeypatch.setenv("SPECWIRE_FRONTEND", "inline")
    assert verifier_flags().frontend == "inline"
    monkeypatch.setenv("SPECWIRE_FRONTEND", "thread")
    with pytest.raises(ValueError, match="--frontend must be inline or process, got 'thread'"):
        verifier_flags()
