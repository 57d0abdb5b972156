"""Each GPU's busy share during a measurement: NVML's utilization.gpu (the share of the last sample period in
which a kernel ran; nvidia-smi reports the same counter), polled on a thread every `interval` seconds and
averaged. Through pynvml (the nvidia-ml-py package) when it imports, else `nvidia-smi -lms`; None without
either. GPU indices are NVML's: run the services with CUDA_DEVICE_ORDER=PCI_BUS_ID so cuda:N is GPU N.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
from collections.abc import Iterator


class GpuBusy:
    def __init__(self, indices: list[int], interval: float = 0.05):
        self.indices, self.interval = indices, interval
        self.samples: dict[int, list[float]] = {i: [] for i in indices}
        self.source = _source() if indices else None
        self._stop, self._paused = threading.Event(), threading.Event()
        self._worker: threading.Thread | subprocess.Popen | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No samples are kept meanwhile (another service's work between this one's, bench_services
        --paired)."""
        self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()

    def __enter__(self) -> GpuBusy:
        if self.source == "pynvml":
            self._worker = threading.Thread(target=self._poll_nvml, daemon=True)
            self._worker.start()
        elif self.source == "nvidia-smi":
            self._worker = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                 f"-lms={max(1, int(self.interval * 1e3))}"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read_smi, args=(self._worker,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if isinstance(self._worker, threading.Thread):
            self._worker.join(5)
        elif isinstance(self._worker, subprocess.Popen):
            self._worker.terminate()
            self._worker.wait(5)

    def result(self) -> dict[str, float | None] | None:
        """{'gpuN': mean busy % over the samples, ..., 'source': how they were read}, or None."""
        if self.source is None:
            return None
        out: dict = {f"gpu{i}": statistics.fmean(s) if s else None for i, s in self.samples.items()}
        return out | {"source": self.source}

    def _poll_nvml(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices}
            while not self._stop.wait(self.interval):
                for i, h in handles.items():
                    busy = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
                    if not self._paused.is_set():
                        self.samples[i].append(busy)
        finally:
            pynvml.nvmlShutdown()

    def _read_smi(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            index, _, busy = line.partition(",")
            if index.strip().isdigit() and int(index) in self.samples and not self._paused.is_set():
                self.samples[int(index)].append(float(busy))


def _source() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return "pynvml"
    except Exception:  # not installed, or no driver: try the command line
        pass
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=10)
        return "nvidia-smi"
    except (OSError, subprocess.SubprocessError):
        return None
