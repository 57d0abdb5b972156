"""Rejection sampler kernel time vs the PyTorch reference and vs the floor of bytes moved (GPU).

Cases at B = 64, k = 4, V = 128256 (float32 logits): dense q, top-K sparse q, one-hot (greedy drafts),
all-greedy rows, and target-only sampling (k = 0). Bytes counted: logits read once, dense q read once (or the
sparse indices + values), draft ids, outputs. The floor is bytes / the measured copy bandwidth (read + write
of a 1 GiB tensor). `kernel` times the launch (kernel + the few small tensors it builds, no host sync);
`api` times rejection_sample end to end (validation, thresholds, one sync); `ref` the reference on the GPU.
Timings flush L2 between runs (triton.testing.do_bench), so the logits come from HBM.

    python bench/bench_rejection_sampler.py --out bench/results/rejection_sampler_h100.json
"""

import argparse
import json
import pathlib
import sys

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
    outputs = B * (int(batch["num_drafts"].max()) + 1) * 8 + B * 4
    return logits.numel() * logits.element_size() + q_bytes + D * 8 + outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--sparse-k", type=int, default=32, help="K of the top-K sparse draft probs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="logits dtype")
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    results = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'case':>12} {'kernel us':>9} {'api us':>8} {'ref us':>9} {'MB':>7} {'floor us':>8} "
          f"{'floor/kernel':>12} {'mean accepted':>13}")
    for name, (mode, k, greedy) in CASES.items():
        batch = make_batch(args.batch, args.vocab, k, mode, seed=1, greedy_frac=greedy, K=args.sparse_k,
                           invalid_frac=0.0, fixed_k=True, device="cuda")
        batch["target_logits"] = batch["target_logits"].to(getattr(torch, args.dtype))
        prepared = prepare_batch(**batch)
        kernel_us = do_bench(lambda prepared=prepared: launch(prepared), return_mode="median") * 1e3
        api_us = do_bench(lambda batch=batch: rejection_sample(**batch), return_mode="median") * 1e3
        ref_us = do_bench(lambda prepared=prepared: sample_ref(prepared), return_mode="median") * 1e3
        moved = bytes_moved(batch, args.sparse_k)
        floor_us = moved / bandwidth * 1e6
        accepted = (rejection_sample(**batch).num_tokens - 1).float().mean().item()
        results.append(dict(case=name, mode=mode, k=k, greedy_fraction=greedy, kernel_us=kernel_us,
                            api_us=api_us, ref_us=ref_us, bytes=moved, floor_us=floor_us,
                            mean_accepted=accepted))
        print(f"{name:>12} {kernel_us:>9.1f} {api_us:>8.1f} {ref_us:>9.1f} {moved / 1e6:>7.1f} "
              f"{floor_us:>8.1f} {floor_us / kernel_us:>12.2f} {accepted:>13.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch, vocab=args.vocab,
        sparse_k=args.sparse_k, logits_dtype=args.dtype, copy_bandwidth_bytes_per_s=bandwidth, cases=results,
    ), indent=1))


if __name__ == "__main__":
    main()
