"""GPU time of a span of queued work, from two CUDA events: the time between the device reaching one point of
its stream and reaching another. Work queued before the span (what it waits for) is left out; where the
device sits idle inside the span, waiting for the host to queue the next kernel, that time is in it."""

from __future__ import annotations

import torch


class GpuSpan:
    """begin() and end() record events on `device`'s current stream; seconds() is the device time between
    them. On a CPU every call is a no-op and seconds() is None."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self._began = torch.cuda.Event(enable_timing=True) if cuda else None
        self._ended = torch.cuda.Event(enable_timing=True) if cuda else None
        self._state = "idle"  # -> "began" -> "ended" -> (seconds) "idle"

    def begin(self) -> None:
        self._record(self._began)
        self._state = "began"

    def end(self) -> None:
        if self._state == "began":
            self._record(self._ended)
            self._state = "ended"

    def seconds(self) -> float | None:
        """The span's device time (waits for its end), once per span; None on a CPU or if it has not ended."""
        if self._began is None or self._state != "ended":
            return None
        self._state = "idle"
        self._ended.synchronize()
        return 1e-3 * self._began.elapsed_time(self._ended)

    def _record(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            with torch.cuda.device(self.device):
                event.record()
