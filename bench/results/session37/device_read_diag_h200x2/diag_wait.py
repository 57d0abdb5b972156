"""Session 37's diagnostic of DeviceDrafts.read on the last of two GPUs (run at 15:50 UTC on 2 x H200, tree
7c372e6 plus this file; same statements as run, reformatted): the read behind a slot wait inside
`torch.cuda.device(cuda:1)` with the process's current device 0, then after `torch.cuda.set_device(cuda:1)`.
    source bench/device_env.sh; CUDA_DEVICE_ORDER=PCI_BUS_ID python3 diag_wait.py
"""

import time

import torch
from specwire.verifier.drafter_link import DeviceDrafts

from specwire.stream_values import HostSlot, SlotWatch, write_value

K = 4
slot = HostSlot()
device = torch.device("cuda", torch.cuda.device_count() - 1)
buffer = torch.zeros(2 * K, 1, dtype=torch.int64, device=device)
written = torch.tensor([[5, 10**9, -3, 7], [1, 2, 99, 100]], device=device)
written.clamp(0, 99).flatten()
drafter = torch.cuda.Stream(device)
with torch.cuda.stream(drafter):
    buffer.view(2, K).copy_(buffer.view(2, K))
torch.cuda.synchronize(device)
print("current device", torch.cuda.current_device())
with torch.cuda.device(device):
    print("in: current device", torch.cuda.current_device(), torch.cuda.current_stream(device).cuda_stream)
    ids = DeviceDrafts(buffer, slot, 1, K, SlotWatch(), 30.0).read(2, 3, vocab_size=100)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    print("blocked", not done.query())
    with torch.cuda.stream(drafter):
        buffer.view(2, K).copy_(written)
        write_value(slot, 1, drafter)
    torch.cuda.synchronize(device)
    print("ids", ids.tolist(), "buffer", buffer.view(-1).tolist(), "slot", slot.value)
slot2 = HostSlot()
torch.cuda.set_device(device)
buffer.zero_()
torch.cuda.synchronize(device)
ids = DeviceDrafts(buffer, slot2, 1, K, SlotWatch(), 30.0).read(2, 3, vocab_size=100)
time.sleep(0.05)
with torch.cuda.stream(drafter):
    buffer.view(2, K).copy_(written)
    write_value(slot2, 1, drafter)
torch.cuda.synchronize(device)
print("set_device: ids", ids.tolist())
for s in (slot, slot2):
    s.unlink()
    s.close()
