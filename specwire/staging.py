"""Host <-> device copies that never hold up another thread: static device inputs written on the host that go
over in one copy, and reads back to the host through pinned memory.

A CUDA graph reads its inputs from fixed device buffers. Filling them with one `copy_` each from pageable
host tensors costs a host call per buffer, and each such copy first waits for the stream (CUDA's rule for
pageable host-to-device copies). Here the buffers are views of one device block, mirrored by one pinned
host block that the caller writes through numpy views (no torch dispatch per field): `send` queues a single
non-blocking copy and returns at once.

Reading back goes through pinned memory too, waited for with an event: a plain `.cpu()` or `.tolist()` of a
CUDA tensor copies into pageable memory, and while that copy waits for the stream, CUDA holds up every other
thread's call into the device (bench/bench_cross_thread_wait.py: a co-located drafter's thread reading its
tables held the verifier's launch until the tables were drafted, about 2 ms a batch-1 round).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specwire.wire import as_numpy

_ALIGN = 16  # bytes: every view starts aligned, as kernels (Triton's especially) like their pointers

HostArray = np.ndarray | torch.Tensor  # host input: numpy, or a tensor (a device one is read back first)
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32}  # numpy's twins of the dtypes inputs come in


def host_array(values: HostArray) -> np.ndarray:
    """`values` as a numpy array: itself, or a tensor's memory (read back from a device first)."""
    return values if isinstance(values, np.ndarray) else values.detach().cpu().numpy()


class StagedInputs:
    """Named device tensors (`tensors`) and numpy views of the same bytes of the host mirror (`host`).

    On a CPU device the host views are the tensors' own memory and `send` copies nothing."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self._offsets: dict[str, int] = {}
        self._row_bytes: dict[str, int] = {}
        end = 0
        for name, (shape, dtype) in fields.items():
            end = -(-end // _ALIGN) * _ALIGN
            self._offsets[name] = end
            self._row_bytes[name] = math.prod(shape[1:]) * dtype.itemsize
            end += math.prod(shape) * dtype.itemsize
        self._block = torch.zeros(end, dtype=torch.uint8, device=device)
        cuda = self._block.is_cuda
        self._host = torch.zeros(end, dtype=torch.uint8).pin_memory() if cuda else self._block
        self._copied = torch.cuda.Event() if cuda else None  # recorded after each copy out of the host block
        self._end = end

        def view(block: torch.Tensor, name: str) -> torch.Tensor:
            shape, dtype = fields[name]
            start = self._offsets[name]
            return block[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

        self.tensors = {name: view(self._block, name) for name in fields}
        self.host: dict[str, np.ndarray] = {name: as_numpy(view(self._host, name)) for name in fields}

    def wait_free(self) -> None:
        """Returns once the host block may be written again (at once unless the last send is still going)."""
        # Queried first: a query keeps the GIL, while synchronize gives it up even for an event long passed,
        # and each give-up on a serving loop's thread may let another thread hold it for a switch interval.
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()

    def send(self, last: str | None = None, rows: int = 0) -> None:
        """Queues the copy of the host block to the device: all of it, or only up to `rows` rows of field
        `last` (the fields before it whole)."""
        if self._copied is None:
            return
        end = self._end if last is None else self._offsets[last] + rows * self._row_bytes[last]
        self._block[:end].copy_(self._host[:end], non_blocking=True)
        self._copied.record()


def upload(values: torch.Tensor, to: torch.device | torch.Tensor) -> torch.Tensor:
    """A small host tensor on the device `to`, or copied into the device tensor `to`, queued without a wait:
    through pinned memory (a copy from pageable memory would first wait for the stream)."""
    device = to.device if isinstance(to, torch.Tensor) else to
    if device.type == "cuda":
        values = values.pin_memory()
    if isinstance(to, torch.Tensor):
        return to.copy_(values, non_blocking=True)
    return values.to(device, non_blocking=True)


class Readback:
    """Device -> host copies into one pinned buffer reused from round to round (grown when too small):
    `start` queues a non-blocking copy, `wait` returns the host tensor once it has landed (CPU tensors pass
    through). What `wait` returned is overwritten by the next `start`."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._copying = False

    def start(self, tensor: torch.Tensor) -> None:
        self._copying = tensor.is_cuda
        if not tensor.is_cuda:
            self._host = tensor
            return
        n, buffer = tensor.numel(), self._buffer
        if buffer is None or buffer.dtype != tensor.dtype or buffer.numel() < n:
            grown = 2 * buffer.numel() if buffer is not None and buffer.dtype == tensor.dtype else 0
            self._buffer = buffer = torch.empty(max(n, grown), dtype=tensor.dtype, pin_memory=True)
        self._host = buffer[:n].view(tensor.shape)
        self._host.copy_(tensor, non_blocking=True)
        with torch.cuda.device(tensor.device):
            self._event = self._event or torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether `wait` would return at once."""
        return not self._copying or self._event.query()

    def wait(self) -> torch.Tensor:
        if not self.ready():  # (queried first: see StagedInputs.wait_free)
            self._event.synchronize()
        return self._host


def read_back(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host (a CPU tensor as it is), through a Readback of its own: pinned memory and an
    event, so that other threads' device calls go on meanwhile (see the module's docstring)."""
    readback = Readback()
    readback.start(tensor)
    return readback.wait()
