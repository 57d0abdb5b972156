import time, torch
from specwire.stream_values import HostSlot, write_value, wait_value
d = torch.device("cuda", 1)
torch.cuda.set_device(d)
for variant in ("plain", "sync_after_wait_launch"):
    slot = HostSlot()
    buf = torch.zeros(8, dtype=torch.int64, device=d)
    src = torch.arange(1, 9, device=d)
    (src.clamp(0, 99) + 1).sum()
    s2 = torch.cuda.Stream(d)
    torch.cuda.synchronize(d)
    cur = torch.cuda.current_stream(d)
    print(variant, "current stream handle", cur.cuda_stream, "s2", s2.cuda_stream)
    wait_value(slot, 1, cur)
    out = buf.clamp(0, 99) + 0
    ev = torch.cuda.Event(); ev.record()
    time.sleep(0.05)
    print(" blocked:", not ev.query())
    with torch.cuda.stream(s2):
        buf.copy_(src)
        write_value(slot, 1, s2)
    torch.cuda.synchronize(d)
    print(" out", out.tolist(), "slot", slot.value)
    slot.unlink(); slot.close()
