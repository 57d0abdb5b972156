"""A GPU stream that waits for a number another process's stream writes (CUDA stream memory operations).

An interprocess CUDA event only orders work queued after the event was recorded: a process that must queue
its work before the other has queued what it waits for (a drafter queuing its drafting while the verifier's
forward is still being launched) needs a wait that does not depend on that order. Here the waiting stream
watches a 64-bit slot of GPU memory until it holds at least a sequence number, and the writing stream writes
that number behind its work (the driver fences the writes before it, so whatever the work wrote is visible
once the number is). Through the driver API with ctypes: torch does not expose these calls.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


@functools.cache
def _peer_access(first: int, second: int) -> None:
    """The driver refuses stream operations on another GPU's memory until peer access is enabled, which torch
    does on the two GPUs' first copies (bench/probe_stream_values.py): one each way."""
    a, b = torch.zeros(1, device=f"cuda:{first}"), torch.zeros(1, device=f"cuda:{second}")
    a.copy_(b)
    b.copy_(a)


def _slot_address(slot: torch.Tensor, stream: torch.cuda.Stream) -> int:
    if not (slot.is_cuda and slot.dtype == torch.int64 and slot.numel() == 1):
        raise ValueError(f"a stream value slot is one int64 of GPU memory, got {slot.dtype} "
                         f"{tuple(slot.shape)} on {slot.device}")
    if slot.device != stream.device:
        _peer_access(*sorted((slot.device.index, stream.device.index)))
    return slot.data_ptr()


def write_value(slot: torch.Tensor, value: int, stream: torch.cuda.Stream) -> None:
    """Queues on `stream` a write of `value` into `slot` behind the work queued on it so far."""
    address = _slot_address(slot, stream)
    with torch.cuda.device(stream.device):
        _check(_driver().cuStreamWriteValue64_v2(stream.cuda_stream, address, value, _WRITE_DEFAULT),
               "cuStreamWriteValue64")


def wait_value(slot: torch.Tensor, value: int, stream: torch.cuda.Stream) -> None:
    """Makes the work queued on `stream` from now on wait until `slot` holds at least `value`. `slot` may
    live on another GPU (peer memory, reachable from this stream's GPU)."""
    address = _slot_address(slot, stream)
    with torch.cuda.device(stream.device):
        _check(_driver().cuStreamWaitValue64_v2(stream.cuda_stream, address, value, _WAIT_GEQ),
               "cuStreamWaitValue64")
