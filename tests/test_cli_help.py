"""`--help` says what every flag defaults to (the newcomer path): each option with a default shows it."""

import argparse

import pytest

from specwire.cli import COMMANDS, build_parser


@pytest.mark.parametrize("command", ["drafter", "verifier", "client", "generate", "demo"])
def test_help_shows_every_default(command):
    assert command in COMMANDS
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = sub.format_help()
    assert "--device" not in text or "default: cuda if available" in text
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            help_text = sub._get_formatter()._get_help_string(action) % {"default": action.default}
            assert "default" in help_text, f"{command} {action.option_strings[0]} hides its default"


def test_a_verifier_drafts_serially_unless_told_otherwise():
    """Session 29 measured tables slower than serial drafting for the default model across two processes
    (bench/results/session29/): a remote drafter's verifier, like a co-located one, waits for each round's
    drafts unless --cache-branches asks for tables."""
    parser = build_parser("verifier")
    for argv in (["verifier", "--drafter", "127.0.0.1:50052"], ["verifier", "--colocated"]):
        args = parser.parse_args(argv)
        assert (args.cache_branches, args.drafting_epoch) == (0, 0), argv
    assert parser.parse_args(["verifier", "--cache-branches", "8"]).cache_branches == 8
