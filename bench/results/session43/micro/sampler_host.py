"""Host time of the sampler's parts on a GPU (chained, no sync): prepare_batch, launch; cProfile of both."""
import cProfile, pstats, statistics, sys, time, io
import numpy as np, torch
from specwire.kernels import rejection_sampler as rs
from specwire.kernels.rejection_sampler_triton import launch
from specwire.engine import follow_sampler, write_drafts
import triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))
dev = torch.device("cuda:0")
V = 49152
for B in (1, 16, 64):
    k = 4
    logits = torch.randn(B * (k + 1), V, device=dev, dtype=torch.float32)
    cols = [np.full(B * k, 7, np.int64), np.full(B, k, np.int32), None, np.zeros(B, np.float32),
            np.zeros(B, np.int32), np.ones(B, np.float32), np.arange(B, dtype=np.int64), np.full(B, 100, np.int64)]
    ids = torch.zeros(64, k + 1, dtype=torch.long, device=dev); pos = torch.zeros(64, dtype=torch.int32, device=dev)
    drafts = torch.zeros(B * k, dtype=torch.long, device=dev)
    t = {"prepare": [], "launch": [], "follow": [], "write": [], "whole": []}
    for i in range(400):
        a = time.perf_counter(); b_ = rs.prepare_batch(logits, *cols); b = time.perf_counter()
        out = launch(b_); c = time.perf_counter()
        follow_sampler(ids, pos, out.packed, V); d = time.perf_counter()
        write_drafts(ids, [k + 1] * B, drafts); e = time.perf_counter()
        rs.rejection_sample(logits, *cols, defer_check=True); f = time.perf_counter()
        if i % 8 == 0: torch.cuda.synchronize()
        if i >= 50:
            for n, x in zip(t, (b - a, c - b, d - c, e - d, f - e)): t[n].append(x)
    print(f"B={B}: " + ", ".join(f"{n} {1e3*statistics.median(v):.3f} ms" for n, v in t.items()), flush=True)
    pr = cProfile.Profile(); pr.enable()
    for i in range(300):
        out = rs.rejection_sample(logits, *cols, defer_check=True)
        follow_sampler(ids, pos, out.packed, V)
        if i % 8 == 0: torch.cuda.synchronize()
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28); print(s.getvalue()[:6000])
