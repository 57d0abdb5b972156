"""Rejection sampler: kernel time vs the PyTorch reference and the floor of bytes moved; API overhead (GPU).

Shapes (default): B = 64, V = 128256 and B = 1, V = 49152 (the default model's vocab), k = 4, float32 logits.
Cases: dense q, top-K sparse q, one-hot (greedy drafts), all-greedy rows, and target-only sampling (k = 0).
Bytes counted: logits read once, dense q read once (or the sparse indices + values), draft ids, outputs. The
floor is bytes / the measured copy bandwidth (read + write of a 1 GiB tensor). Columns:
  kernel    the launch of a prepared batch (kernel + the small tensors it allocates, no host sync);
  api       the eager call end to end, read as callers did before token_lists(): rejection_sample
            (validation, thresholds, the bad-input check's sync), then tokens and num_tokens .cpu().tolist();
  deferred  rejection_sample(..., defer_check=True).token_lists() end to end (one device->host copy);
  host      the CPU time of the deferred call alone (perf_counter around it, queue drained before each call,
            median of --host-calls calls): what the verifier's hot loop pays on the host;
  ref       the reference on the GPU.
Draft ids are given on the host, as the verifier has them; q on the device. Timings other than host flush L2
between runs (triton.testing.do_bench), so the logits come from HBM.

    python bench/bench_rejection_sampler.py --out bench/results/rejection_sampler_h100.json
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from specwire.kernels.rejection_sampler import prepare_batch, rejection_sample  # noqa: E402
from specwire.kernels.rejection_sampler_ref import sample_ref  # noqa: E402
from specwire.kernels.rejection_sampler_triton import launch  # noqa: E402
from test_rejection_sampler import make_batch  # noqa: E402

CASES = {  # name: (mode, k, greedy fraction)
    "dense": ("dense", 4, 0.0),
    "sparse": ("sparse", 4, 0.0),
    "one-hot": ("none", 4, 0.0),
    "greedy": ("none", 4, 1.0),
    "target-only": ("none", 0, 0.0),
}


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device copy, counting the read and the write."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def bytes_moved(batch: dict, K: int) -> int:
    logits, B = batch["target_logits"], batch["num_drafts"].numel()
    D, V = batch["draft_token_ids"].numel(), logits.shape[1]
    q = batch["draft_probs"]
    q_bytes = 0 if q is None else D * V * 4 if q.is_dense else D * K * (8 + 4)
    outputs = B * (int(batch["num_drafts"].max()) + 2) * 8  # count + tokens, int64
    return logits.numel() * logits.element_size() + q_bytes + D * 8 + outputs


def eager_read(batch: dict) -> tuple[list, list]:
    out = rejection_sample(**batch)
    return out.tokens.cpu().tolist(), out.num_tokens.cpu().tolist()


def deferred_read(batch: dict) -> list[list[int]]:
    return rejection_sample(**batch, defer_check=True).token_lists()


def host_us(batch: dict, calls: int) -> float:
    """Median CPU time of one deferred call; the queue is drained first, so the call never waits on it."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rejection_sample(**batch, defer_check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["64x128256", "1x49152"], help="BATCHxVOCAB")
    parser.add_argument("--sparse-k", type=int, default=32, help="K of the top-K sparse draft probs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="logits dtype")
    parser.add_argument("--host-calls", type=int, default=500)
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    results = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'B':>3} {'V':>6} {'case':>11} {'kernel us':>9} {'api us':>7} {'deferred us':>11} {'host us':>7} "
          f"{'ref us':>8} {'MB':>6} {'floor us':>8} {'floor/kernel':>12} {'accepted':>8}")
    for shape in args.shapes:
        B, V = (int(v) for v in shape.split("x"))
        for name, (mode, k, greedy) in CASES.items():
            batch = make_batch(B, V, k, mode, seed=1, greedy_frac=greedy, K=args.sparse_k, invalid_frac=0.0,
                               fixed_k=True, device="cuda")
            batch["target_logits"] = batch["target_logits"].to(getattr(torch, args.dtype))
            batch["draft_token_ids"] = batch["draft_token_ids"].cpu()
            prepared = prepare_batch(**batch)
            row = dict(B=B, V=V, case=name, mode=mode, k=k, greedy_fraction=greedy)
            row["kernel_us"] = do_bench(lambda p=prepared: launch(p), return_mode="median") * 1e3
            row["api_us"] = do_bench(lambda b=batch: eager_read(b), return_mode="median") * 1e3
            row["deferred_us"] = do_bench(lambda b=batch: deferred_read(b), return_mode="median") * 1e3
            row["host_us"] = host_us(batch, args.host_calls)
            row["ref_us"] = do_bench(lambda p=prepared: sample_ref(p), return_mode="median") * 1e3
            row["bytes"] = bytes_moved(batch, args.sparse_k)
            row["floor_us"] = row["bytes"] / bandwidth * 1e6
            counts = [len(t) for t in deferred_read(batch)]
            row["mean_accepted"] = sum(counts) / len(counts) - 1
            results.append(row)
            print(f"{B:>3} {V:>6} {name:>11} {row['kernel_us']:>9.1f} {row['api_us']:>7.1f} "
                  f"{row['deferred_us']:>11.1f} {row['host_us']:>7.1f} {row['ref_us']:>8.1f} "
                  f"{row['bytes'] / 1e6:>6.1f} {row['floor_us']:>8.1f} "
                  f"{row['floor_us'] / row['kernel_us']:>12.2f} {row['mean_accepted']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, sparse_k=args.sparse_k,
        logits_dtype=args.dtype, copy_bandwidth_bytes_per_s=bandwidth, cases=results,
    ), indent=1))


if __name__ == "__main__":
    main()
