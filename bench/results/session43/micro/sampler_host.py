"""Host time of the sampler's parts on a GPU, chained (no sync inside; a sync every 8 calls): prepare_batch,
the Triton launch, engine.follow_sampler, engine.write_drafts, then rejection_sample whole; medians of 350
calls at batch 1, 16 and 64, SmolLM2's vocabulary, k = 4; then a cProfile of 300 sampler + follow calls.
Run from a tree's root after `source bench/device_env.sh` (session 43 ran it on one H100 and on 2 x H200,
against dfe6bf6's tree in the same call; reformatted for ruff after the runs, same statements). The trees it
ran on had follow_sampler in specwire.engine; since 2e6006d it is in specwire.kernels.ops, so at later trees
the import below must name that module."""

import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
import triton
from specwire.kernels import rejection_sampler as rs
from specwire.kernels.rejection_sampler_triton import launch

from specwire.engine import follow_sampler, write_drafts

print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))
dev = torch.device("cuda:0")
V, k = 49152, 4
for B in (1, 16, 64):
    logits = torch.randn(B * (k + 1), V, device=dev, dtype=torch.float32)
    cols = [np.full(B * k, 7, np.int64), np.full(B, k, np.int32), None, np.zeros(B, np.float32),
            np.zeros(B, np.int32), np.ones(B, np.float32), np.arange(B, dtype=np.int64),
            np.full(B, 100, np.int64)]
    ids = torch.zeros(64, k + 1, dtype=torch.long, device=dev)
    pos = torch.zeros(64, dtype=torch.int32, device=dev)
    drafts = torch.zeros(B * k, dtype=torch.long, device=dev)
    t: dict[str, list[float]] = {"prepare": [], "launch": [], "follow": [], "write": [], "whole": []}
    for i in range(400):
        a = time.perf_counter()
        batch = rs.prepare_batch(logits, *cols)
        b = time.perf_counter()
        out = launch(batch)
        c = time.perf_counter()
        follow_sampler(ids, pos, out.packed, V)
        d = time.perf_counter()
        write_drafts(ids, [k + 1] * B, drafts)
        e = time.perf_counter()
        rs.rejection_sample(logits, *cols, defer_check=True)
        f = time.perf_counter()
        if i % 8 == 0:
            torch.cuda.synchronize()
        if i >= 50:
            for name, x in zip(t, (b - a, c - b, d - c, e - d, f - e), strict=True):
                t[name].append(x)
    medians = ", ".join(f"{n} {1e3 * statistics.median(v):.3f} ms" for n, v in t.items())
    print(f"B={B}: {medians}", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for i in range(300):
        out = rs.rejection_sample(logits, *cols, defer_check=True)
        follow_sampler(ids, pos, out.packed, V)
        if i % 8 == 0:
            torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(28)
    print(text.getvalue()[:6000])
