"""Command-line entry point: `specwire <command>`."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("specwire: not yet implemented", file=sys.stderr)
    return 2
