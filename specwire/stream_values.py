"""A GPU stream that waits for a number another process's stream writes (CUDA stream memory operations).

An interprocess CUDA event only orders work queued after the event was recorded: a process that must queue
its work before the other has queued what it waits for (a drafter queuing its drafting while the verifier's
forward is still being launched) needs a wait that does not depend on that order. Here the waiting stream
watches a 64-bit slot until it holds at least a sequence number, and the writing stream writes that number
behind its work (the driver fences the writes before it, so whatever the work wrote is visible once the
number is). The slot is host memory both processes map (a file under /dev/shm, registered for every GPU):
a slot in one GPU's memory mapped by CUDA IPC is refused by the other GPU's stream operations
(bench/probe_stream_values.py). Through the driver API with ctypes: torch does not expose these calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                 ctypes.c_uint]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


SLOT_DIR, SLOT_PREFIX = "/dev/shm", "specwire-slot-"
# A slot value every wait accepts. The GPU's wait (CU_STREAM_WAIT_VALUE_GEQ) compares cyclically, until
# (int64)(slot - wanted) >= 0, so the all-ones value reads as -1 and ends no wait for a step number (it was
# this value until session 42, when a verifier's GPU stayed waiting for a killed drafter's drafts); 2**62 is
# ahead of every number a stream counts to.
RELEASED = 2**62


class HostSlot:
    """A 64-bit number in host memory shared by this host's processes (a file under /dev/shm, created by
    one, opened by the others by its path) and mapped for the GPUs of each. value: what the host reads now."""

    SIZE = mmap.PAGESIZE

    def __init__(self, path: str | None = None):
        """A new slot (holding 0) when path is None, else the one another process created at `path`."""
        create = path is None
        self.path = path = path or f"{SLOT_DIR}/{SLOT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        if os.path.dirname(path) != SLOT_DIR or not os.path.basename(path).startswith(SLOT_PREFIX):
            raise ValueError(f"a slot is a file {SLOT_DIR}/{SLOT_PREFIX}*, not {path!r}")
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            elif os.fstat(fd).st_size < self.SIZE:
                raise ValueError(f"{path} is not a slot ({os.fstat(fd).st_size} bytes)")
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self._cell = ctypes.c_uint64.from_buffer(self._map)
        self._address: int | None = None

    @property
    def address(self) -> int:
        """The slot's address for the GPUs' stream operations (registered with CUDA on first use)."""
        if self._address is None:
            host = ctypes.addressof(self._cell)
            torch.cuda.init()  # a current context for the driver's calls
            driver, device = _driver(), ctypes.c_uint64()
            _check(driver.cuMemHostRegister_v2(host, self.SIZE, _REGISTER_PORTABLE_DEVICEMAP),
                   "cuMemHostRegister")
            _check(driver.cuMemHostGetDevicePointer_v2(ctypes.byref(device), host, 0),
                   "cuMemHostGetDevicePointer")
            self._address = device.value
        return self._address

    @property
    def value(self) -> int:
        return self._cell.value

    @property
    def closed(self) -> bool:
        return self._map.closed

    def set(self, value: int) -> None:
        """Writes from the host (a wait that must end whatever the GPUs do)."""
        self._cell.value = value

    def unlink(self) -> None:
        """Removes the file (the mappings stay): once every process has mapped it, or never will."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._address is not None:
            _driver().cuMemHostUnregister(ctypes.addressof(self._cell))
        del self._cell
        self._map.close()


@functools.cache
def _primary_context(index: int) -> int:
    driver, device, context = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(driver.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context.value


@contextlib.contextmanager
def _context_of(stream: torch.cuda.Stream):
    """Makes the driver's current context the one of `stream`'s device. A device's default stream is handle
    0, which the driver resolves against the thread's current context; `torch.cuda.device` does not always
    make that context current (session 37: inside `torch.cuda.device(cuda:1)` the context stayed device 0's,
    so a wait on cuda:1's default stream went to cuda:0's and the work behind it read stale drafts)."""
    driver = _driver()
    _check(driver.cuCtxPushCurrent_v2(_primary_context(stream.device.index)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def write_value(slot: HostSlot, value: int, stream: torch.cuda.Stream) -> None:
    """Queues on `stream` a write of `value` into `slot` behind the work queued on it so far."""
    address = slot.address
    with _context_of(stream):
        _check(_driver().cuStreamWriteValue64_v2(stream.cuda_stream, address, value, _WRITE_DEFAULT),
               "cuStreamWriteValue64")


def wait_value(slot: HostSlot, value: int, stream: torch.cuda.Stream) -> None:
    """Makes the work queued on `stream` from now on wait until `slot` holds at least `value`."""
    address = slot.address
    with _context_of(stream):
        _check(_driver().cuStreamWaitValue64_v2(stream.cuda_stream, address, value, _WAIT_GEQ),
               "cuStreamWaitValue64")


class SlotWatch:
    """Writes a slot's number from the host when a GPU has waited for it too long (the writer stalled or
    died), from a thread of its own: the thread that queued the wait may itself be held in a CUDA call that
    waits for that GPU. One wait watched at a time, the latest: a new one replaces it. The thread sleeps
    until the deadline, so an unchanged due costs nothing a round."""

    def __init__(self, on_release: Callable[[], None] = lambda: None):
        self.on_release = on_release
        self._ready = threading.Condition()
        self._due: tuple[HostSlot, int, float] | None = None
        self._thread: threading.Thread | None = None

    def watch(self, slot: HostSlot, value: int, seconds: float) -> None:
        with self._ready:
            at = time.monotonic() + seconds
            sooner = self._due is None or at < self._due[2]
            self._due = (slot, value, at)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="slot-watch", daemon=True)
                self._thread.start()
            elif sooner:  # else the thread wakes at the earlier deadline and finds this one
                self._ready.notify()

    def _run(self) -> None:
        with self._ready:
            while True:
                if self._due is None:
                    self._ready.wait()
                    continue
                slot, value, at = self._due
                if (left := at - time.monotonic()) > 0:
                    self._ready.wait(left)
                    continue
                self._due = None
                with contextlib.suppress(ValueError, AttributeError):  # (the slot closed meanwhile)
                    if not slot.closed and slot.value < value:
                        slot.set(value)
                        self.on_release()
