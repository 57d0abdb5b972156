"""Why DeviceDrafts.read read stale drafts on the last of two GPUs in session 37 (bench/results/session37/):
each variant runs in a process of its own (lazy module loading is per process) and prints whether the ids read
behind the slot wait are the ones written after it, and which device the driver's current context was on at
the wait. Variants: the wait made inside `torch.cuda.device(last)` or after `torch.cuda.set_device(last)`; the
read's kernels launched once before the wait or not; CUDA_MODULE_LOADING lazy or eager.

    source bench/device_env.sh; CUDA_DEVICE_ORDER=PCI_BUS_ID python3 bench/probe_device_drafts.py
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
import time

K = 4
WRITTEN = [[5, 10**9, -3, 7], [1, 2, 99, 100]]
EXPECTED = [5, 99, 0, 1, 2, 99]


def context_device() -> int:
    lib, device = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(-1)
    return device.value if lib.cuCtxGetDevice(ctypes.byref(device)) == 0 else -1


def variant(scope: str, warm: bool) -> None:
    import torch
    from specwire.verifier.drafter_link import DeviceDrafts

    from specwire.stream_values import HostSlot, SlotWatch, write_value

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    slot = HostSlot()
    buffer = torch.zeros(2 * K, 1, dtype=torch.int64, device=device)
    written = torch.tensor(WRITTEN, device=device)
    drafter = torch.cuda.Stream(device)
    with torch.cuda.stream(drafter):
        buffer.view(2, K).copy_(buffer.view(2, K))
    if warm:
        DeviceDrafts.pick(buffer, [(0, 3), (1, 3)], K, 100)
    torch.cuda.synchronize(device)
    if scope == "set_device":
        torch.cuda.set_device(device)
    with torch.cuda.device(device):
        at_wait = context_device()
        ids = DeviceDrafts(buffer, slot, 1, K, SlotWatch(), 30.0).read([(0, 3), (1, 3)], vocab_size=100)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        waited = not done.query()
        with torch.cuda.stream(drafter):
            buffer.view(2, K).copy_(written)
            write_value(slot, 1, drafter)
        torch.cuda.synchronize(device)
        got = ids.tolist()
    slot.unlink()
    slot.close()
    print(f"scope={scope:12} warm={warm!s:5} loading={os.environ.get('CUDA_MODULE_LOADING', 'default'):7} "
          f"context device at the wait={at_wait} waited={waited} read={'ok' if got == EXPECTED else got}")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        variant(sys.argv[1], sys.argv[2] == "1")
        sys.exit(0)
    for loading, scope, warm in itertools.product(("LAZY", "EAGER"), ("device_scope", "set_device"), (0, 1)):
        env = dict(os.environ, CUDA_MODULE_LOADING=loading)
        try:
            subprocess.run([sys.executable, __file__, scope, str(warm)], env=env, timeout=30, check=False)
        except subprocess.TimeoutExpired:  # (a first launch behind the wait that waits for the device)
            print(f"scope={scope:12} warm={bool(warm)!s:5} loading={loading:7} hung for 30 s")
