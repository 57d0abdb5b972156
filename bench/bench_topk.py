"""torch.topk against a two-stage top-k (each chunk's top k, then the top k of those), as the drafter's
sampled drafts take it: logits [B, V] float32, k = 64, inside a CUDA graph (the drafter's steps are graphed,
so launch cost does not count). Checks that both give the same values per row, then times each graph's replay.

    python bench/bench_topk.py --out bench/results/topk_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from specwire.drafter.draft_sampling import top_k_rows


def timed_graph(fn, x: torch.Tensor, iters: int) -> float:
    """Mean microseconds per replay of a graph of fn(x)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--vocab-sizes", default="16384,49152")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for V in map(int, args.vocab_sizes.split(",")):
        for B in map(int, args.batch_sizes.split(",")):
            x = torch.randn(B, V, device="cuda") * 3
            a, b = x.topk(args.k, dim=-1), top_k_rows(x, args.k)
            same = torch.equal(a.values, b.values) and torch.equal(x.gather(1, b.indices), b.values)
            row = {"batch": B, "vocab": V, "k": args.k, "same_values": same,
                   "torch_topk_us": timed_graph(lambda t: t.topk(args.k, dim=-1), x, args.iters),
                   "two_stage_us": timed_graph(lambda t: top_k_rows(t, args.k), x, args.iters)}
            rows.append(row)
            print(row, flush=True)
    report = {"bench": "topk", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
