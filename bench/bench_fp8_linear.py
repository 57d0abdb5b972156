"""A draft head's matmuls in bf16 and in FP8 (specwire.model.Linear.quantize_fp8), timed on a GPU.

The Llama-3.1-8B EAGLE-3 head's five linears (fc over the three fused features, the layer's q/k/v over
[embedding, hidden], o, gate/up, down, and the 32,000-token draft lm_head) at the row counts a draft step
feeds: 1 and 16 rows (one token per request), 5 and 80 (the first step after a verification, k = 4). At
these sizes every matmul is bound by reading its weight, which FP8 halves; the FP8 path also quantises its
input per row. Times are per call, replayed from a CUDA graph of 20 calls (launches included, as in the
drafter's graphs); the error is max |fp8 - bf16| / max |bf16| of the same outputs.

    python bench/bench_fp8_linear.py --out bench/results/fp8_linear_h200.json
"""

import argparse
import datetime
import functools
import json
import platform

import torch
from specwire.drafter.train_eagle import code_commit

from specwire.model import Linear

HIDDEN, MLP, DRAFT_VOCAB = 4096, 14336, 32000  # Llama-3.1-8B; the published EAGLE-3 head's draft vocabulary
LINEARS = {  # name: (in, out)
    "fc": (3 * HIDDEN, HIDDEN),
    "qkv_proj": (2 * HIDDEN, HIDDEN + 2 * 1024),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (HIDDEN, 2 * MLP),
    "down_proj": (MLP, HIDDEN),
    "lm_head": (HIDDEN, DRAFT_VOCAB),
}
ROWS = (1, 5, 16, 80)


def graph_time_us(fn, reps: int = 20, replays: int = 20) -> float:
    """Mean time of one fn() call, replayed from a CUDA graph that holds `reps` calls."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * replays)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for name, (k, n) in LINEARS.items():
        linear = Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
        torch.nn.init.normal_(linear.weight, std=0.02)
        quantised = Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
        quantised.weight.data.copy_(linear.weight)
        quantised.quantize_fp8()
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            with torch.inference_mode():
                ref, out = linear(x), quantised(x)
                bf16_us = graph_time_us(functools.partial(linear, x))
                fp8_us = graph_time_us(functools.partial(quantised, x))
            error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            weight_mb = k * n * 2 / 1e6
            rows_out.append({"linear": name, "in": k, "out": n, "rows": m, "bf16_us": round(bf16_us, 2),
                             "fp8_us": round(fp8_us, 2), "speedup": round(bf16_us / fp8_us, 2),
                             "bf16_weight_gb_per_s": round(weight_mb / bf16_us / 1e-3 / 1e3, 0),
                             "max_rel_error": round(error, 4)})
            print(f"{name:13s} {k:6d}x{n:6d} rows {m:3d}: bf16 {bf16_us:7.1f} us  fp8 {fp8_us:7.1f} us  "
                  f"x{bf16_us / fp8_us:4.2f}  err {error:.4f}")
    for m in ROWS:
        bf16 = sum(r["bf16_us"] for r in rows_out if r["rows"] == m and r["linear"] != "fc")
        fp8 = sum(r["fp8_us"] for r in rows_out if r["rows"] == m and r["linear"] != "fc")
        print(f"a draft step's linears (all but fc), rows {m}: bf16 {bf16:.1f} us, fp8 {fp8:.1f} us")
    if args.out:
        result = {
            "bench": "bench_fp8_linear.py",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": code_commit(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "host": platform.node(),
            "metric": "us per call, CUDA graph of 20 calls; error max|fp8-bf16|/max|bf16|",
            "results": rows_out,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
