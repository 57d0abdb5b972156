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
