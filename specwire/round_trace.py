"""Timestamps of a round's landmarks in both services, for finding where a round's wall time goes between two
processes (bench/round_timeline.py lines them up). py-spy and torch.profiler slow every thread they watch;
this costs a clock read and an append per mark.

Off unless SPECWIRE_TRACE_DIR is set. Then each process keeps its last 200,000 marks, each the
perf_counter_ns() clock (CLOCK_MONOTONIC: one clock for all processes of a host), an event name and an
integer (a batch size, a byte count), and writes them to TRACE_DIR/<name>-<pid>.txt when it exits.
"""

from __future__ import annotations

import atexit
import collections
import os
import time
from pathlib import Path

_marks: collections.deque | None = None


def start(name: str) -> None:
    """Turns marking on for this process if SPECWIRE_TRACE_DIR is set (once: a second call does nothing)."""
    global _marks
    out_dir = os.environ.get("SPECWIRE_TRACE_DIR")
    if not out_dir or _marks is not None:
        return
    _marks = collections.deque(maxlen=200_000)
    atexit.register(_write, Path(out_dir) / f"{name}-{os.getpid()}.txt")


def mark(event: str, value: int = 0) -> None:
    if _marks is not None:
        _marks.append((time.perf_counter_ns(), event, value))  # deque.append is atomic: any thread


def _write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{ns} {event} {value}\n" for ns, event, value in list(_marks)))
