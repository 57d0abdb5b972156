"""Command-line entry point: `specwire <command>`.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`. Only the chosen
command's module is imported, so `specwire generate` never pays for (or needs) grpc; commands whose module
does not exist are left out of `specwire --help`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("specwire.commands.demo", "start drafter + verifier locally and stream a few prompts"),
    "generate": ("specwire.commands.generate", "target-only generation, in-process"),
    "drafter": ("specwire.drafter.cli", "run the drafter gRPC service"),
    "verifier": ("specwire.verifier.cli", "run the verifier gRPC service"),
    "verifier-frontend": ("specwire.verifier.frontend",
                          "the verifier's client-facing process (started by `verifier --frontend process`)"),
    "client": ("specwire.commands.client", "send a prompt to a running verifier"),
    "bench": ("specwire.commands.bench", "measure acceptance and speed"),
    "train-eagle": ("specwire.drafter.train_eagle", "train an EAGLE draft head"),
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS) or action.default == []):
            return text
        return f"{text} (default: %(default)s)"


def _module_exists(module_path: str) -> bool:
    try:
        return importlib.util.find_spec(module_path) is not None
    except ImportError:  # a missing parent package
        return False


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s module is imported to fill in its arguments."""
    parser = argparse.ArgumentParser(prog="specwire", description="Speculative decoding over gRPC.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_path, help_text) in COMMANDS.items():
        if not _module_exists(module_path):
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text,
                                    formatter_class=_DefaultsFormatter)
        if name == command:
            module = importlib.import_module(module_path)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
        return int(args.run(args))
    except ValueError as e:  # bad input (ModelLoadError included): one line, no traceback
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"specwire: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
