"""Where a verifier's device time goes, round by round, from CUDA events on its stream, never waited for.

Each verification's own device time runs from its forward's start to its sampler's end (work queued before
it, such as a wait for drafts, is left out; idle time while the host launches it is in). Between one
verification's end and the next one's start the device either runs other work (a prefill: that gap is not
counted) or sits idle, for one of two reasons, split at the point where the host queues the round's first
work: before it, the next round was not launched yet ("launch": the host's own work, or the host waiting for
a drafter's answer); after it, the launched work waits for drafts a drafter process writes on this GPU
("drafts"). The events of a round are read once the device has passed them, at the next call of `take`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class RoundTimes:
    verify_seconds: float
    launch_seconds: float | None  # idle before it, waiting for its launch; None: not measured (other work)
    drafts_seconds: float | None  # idle before it, launched, waiting for drafts; None: it did not wait


@dataclass
class _Round:
    previous_end: torch.cuda.Event | None
    queued: torch.cuda.Event | None
    began: torch.cuda.Event
    ended: torch.cuda.Event | None = None


class VerificationClock:
    """On a CPU every call is a no-op and `take` returns nothing. idle: whether the gaps between verifications
    are idle time (False where a co-located drafter's work runs in them)."""

    def __init__(self, device: torch.device, idle: bool = True):
        self.device, self.idle = device, idle
        self._cuda = device.type == "cuda"
        self._last_end: torch.cuda.Event | None = None  # the last verification's end, if nothing ran since
        self._queued: torch.cuda.Event | None = None
        self._current: _Round | None = None
        self._pending: deque[_Round] = deque()
        self._spare: list[torch.cuda.Event] = []  # events of rounds taken, recorded again (none made a round)

    def round_queued(self) -> None:
        """The host queues the next round's first work now, before what it waits for (drafts on the GPU)."""
        if self._cuda:
            self._queued = self._record()

    def verification_began(self) -> None:
        if self._cuda:
            self._current = _Round(self._last_end, self._queued, self._record())
            self._queued = None

    def verification_ended(self) -> None:
        if self._current is not None:
            self._current.ended = self._record()
            self._last_end = self._current.ended if self.idle else None
            self._pending.append(self._current)
            self._current = None

    def other_work(self) -> None:
        """Something else is queued on the device now (a prefill): the time before the next verification
        is not idle."""
        self._last_end = self._queued = None

    def take(self) -> list[RoundTimes]:
        """The rounds whose verification the device has finished, oldest first, each once."""
        out = []
        while self._pending and self._pending[0].ended.query():
            r = self._pending.popleft()
            launch = drafts = None
            if r.previous_end is not None:
                launched = r.queued or r.began
                launch = 1e-3 * r.previous_end.elapsed_time(launched)
                drafts = None if r.queued is None else 1e-3 * r.queued.elapsed_time(r.began)
            out.append(RoundTimes(1e-3 * r.began.elapsed_time(r.ended), launch, drafts))
            # read for the last time: its `ended` stays, the next round's previous_end
            self._spare += [e for e in (r.previous_end, r.queued, r.began) if e is not None]
        return out

    def _record(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        # On the device's current stream, without making the device current (two calls into the driver more,
        # three times a round on the path from one verification's tokens to the next launch)
        event.record(torch.cuda.current_stream(self.device))
        return event
