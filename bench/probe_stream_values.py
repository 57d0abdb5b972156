"""Which cross-GPU waits work on this machine (one process, two GPUs): the driver's stream memory operations
(32- and 64-bit, on local and on peer memory, with peer access enabled by a copy and by the driver) and a
Triton kernel that spins on a slot of peer memory. Prints one line per probe."""

from __future__ import annotations

import ctypes
import time

import torch
import triton
import triton.language as tl

lib = ctypes.CDLL("libcuda.so.1")
for n in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2",
          "cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
    f = getattr(lib, n)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]


def attr(a: int, dev: int) -> int:
    v = ctypes.c_int()
    r = lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev)
    return v.value if r == 0 else -r


for a, name in ((92, "STREAM_MEM_OPS_V1"), (93, "64_BIT_STREAM_MEM_OPS_V1"), (94, "WAIT_VALUE_NOR_V1"),
                (98, "CAN_FLUSH_REMOTE_WRITES"), (97, "HOST_NATIVE_ATOMIC")):
    print("attribute", name, [attr(a, d) for d in range(2)])

d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")


def op(name: str, stream: torch.cuda.Stream, t: torch.Tensor, value: int) -> str:
    with torch.cuda.device(stream.device):
        r = getattr(lib, name)(stream.cuda_stream, t.data_ptr(), value, 0)
    torch.cuda.synchronize(stream.device)
    return f"{name} {'ok' if r == 0 else f'error {r}'}"


for label, stream_dev, mem_dev in (("local", d0, d0), ("peer before p2p", d0, d1)):
    s = torch.cuda.current_stream(stream_dev)
    for bits, dtype in ((64, torch.int64), (32, torch.int32)):
        t = torch.ones(1, dtype=dtype, device=mem_dev)
        print(label, op(f"cuStreamWriteValue{bits}_v2", s, t, 5), op(f"cuStreamWaitValue{bits}_v2", s, t, 5))
# peer access by copies both ways (at::cuda::get_p2p_access)
torch.ones(1, device=d0).copy_(torch.ones(1, device=d1))
torch.ones(1, device=d1).copy_(torch.ones(1, device=d0))
for label, stream_dev, mem_dev in (("peer after copies, stream 0 mem 1", d0, d1), ("stream 1 mem 0", d1, d0)):
    s = torch.cuda.current_stream(stream_dev)
    for bits, dtype in ((64, torch.int64), (32, torch.int32)):
        t = torch.ones(1, dtype=dtype, device=mem_dev)
        print(label, op(f"cuStreamWriteValue{bits}_v2", s, t, 5), op(f"cuStreamWaitValue{bits}_v2", s, t, 5))


@triton.jit
def spin(slot_ptr, value, limit, out_ptr):
    seen = tl.load(slot_ptr, volatile=True)
    i = 0
    while (seen < value) & (i < limit):
        seen = tl.load(slot_ptr, volatile=True)
        i += 1
    tl.store(out_ptr, i)


slot = torch.zeros(1, dtype=torch.int64, device=d1)
spins = torch.zeros(1, dtype=torch.int64, device=d0)
marker = torch.zeros(1, dtype=torch.int64, device=d0)
for trial in range(3):
    seq = trial + 1
    with torch.cuda.device(d0):
        spin[(1,)](slot, seq, 1 << 30, spins)
        marker.fill_(seq)  # behind the spin
    with torch.cuda.device(d1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU 1, then the write
        slot.fill_(seq)
    t0 = time.perf_counter()
    torch.cuda.synchronize(d0)
    print(f"triton spin on peer memory, trial {trial}: waited {1e3 * (time.perf_counter() - t0):.1f} ms, "
          f"spins {int(spins)}, marker {int(marker)} (want {seq})")
# latency: GPU 1 writes, GPU 0 spins, many rounds
t0 = time.perf_counter()
for seq in range(10, 1010):
    with torch.cuda.device(d0):
        spin[(1,)](slot, seq, 1 << 30, spins)
    with torch.cuda.device(d1):
        slot.fill_(seq)
torch.cuda.synchronize(d0)
print(f"1000 spin/fill pairs: {1e3 * (time.perf_counter() - t0):.1f} ms")
