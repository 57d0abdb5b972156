"""torch.profiler around a window of a service's model steps, for finding where a step's time goes.

Off unless SPECWIRE_PROFILE_DIR is set. Then, after SPECWIRE_PROFILE_SKIP steps (default 200: past warm-up
and graph capture), the next SPECWIRE_PROFILE_STEPS steps (default 30) are recorded, CPU ops of every thread
of the process and the GPU's kernels, and written once to PROFILE_DIR/<name>-<pid>.json (a Chrome trace:
chrome://tracing or ui.perfetto.dev) and .txt (the ops by total device time, then by CPU time).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("specwire.profile")


class StepProfiler:
    def __init__(self, name: str):
        self.name = name
        self.out_dir = os.environ.get("SPECWIRE_PROFILE_DIR") or None
        self.skip = int(os.environ.get("SPECWIRE_PROFILE_SKIP", "200"))
        self.steps = int(os.environ.get("SPECWIRE_PROFILE_STEPS", "30"))
        self._seen = 0
        self._profile: torch.profiler.profile | None = None

    def step(self) -> None:
        """Called by the model thread after each step."""
        if self.out_dir is None:
            return
        self._seen += 1
        if self._seen == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
        elif self._seen == self.skip + self.steps and self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._write(self._profile)
            self._profile, self.out_dir = None, None  # once per process

    def _write(self, profile: torch.profiler.profile) -> None:
        base = Path(self.out_dir) / f"{self.name}-{os.getpid()}"
        base.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(base.with_suffix(".json")))
        ops = profile.key_averages()
        tables = [ops.table(sort_by=key, row_limit=25) for key in ("device_time_total", "cpu_time_total")]
        base.with_suffix(".txt").write_text(f"{self.steps} steps\n\n" + "\n\n".join(tables))
        log.info("profile written", extra={"path": str(base), "steps": self.steps})
