"""The few CUDA driver calls torch does not expose, through ctypes: stream memory operations
(stream_values), host registration, peer access and copies queued on a stream of one's own choosing
(shared_features.copy_rows). Every call that takes a stream runs with that stream's device's primary context
current (`context_of`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import torch

_PEER_ACCESS_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


@functools.cache
def driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxEnablePeerAccess.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                 ctypes.c_uint]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


@functools.cache
def _primary_context(index: int) -> int:
    lib, device, context = driver(), ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context.value


@contextlib.contextmanager
def context_of(device: torch.device) -> Iterator[None]:
    """Makes the driver's current context the primary one of CUDA `device`. A device's default stream is
    handle 0, which the driver resolves against the thread's current context; `torch.cuda.device` does not
    always make that context current (session 37: inside `torch.cuda.device(cuda:1)` the context stayed
    device 0's, so a wait on cuda:1's default stream went to cuda:0's and the work behind it read stale
    drafts)."""
    lib = driver()
    check(lib.cuCtxPushCurrent_v2(_primary_context(device.index)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


@functools.cache
def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Lets work on `device` read and write `peer`'s memory directly (over NVLink or PCIe), once a pair.
    Where the pair cannot, copies between them still work, staged by the driver."""
    if not torch.cuda.can_device_access_peer(device.index, peer.index):
        return
    torch.cuda.init()
    with context_of(device):
        result = driver().cuCtxEnablePeerAccess(_primary_context(peer.index), 0)
    if result != _PEER_ACCESS_ALREADY_ENABLED:  # (torch enables it for its own copies)
        check(result, "cuCtxEnablePeerAccess")


def copy_async(destination: int, source: int, size: int, stream: torch.cuda.Stream) -> None:
    """Queues on `stream` a copy of `size` bytes between device (or mapped) addresses, whichever GPU holds
    them: the copy is `stream`'s device's work alone."""
    with context_of(stream.device):
        check(driver().cuMemcpyAsync(destination, source, size, stream.cuda_stream), "cuMemcpyAsync")
