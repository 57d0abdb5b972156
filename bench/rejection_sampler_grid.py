"""Triton rejection sampler vs the PyTorch reference over the full grid; reports mismatch counts.

Grid: batch {1, 8, 32, 128} x max k {0, 1, 2, 4, 8} x V {100, 8193, 49152, 128256} x draft probs
{none, dense, sparse (K = 32)}, mixed greedy and random rows, 40 % of requests with top-k/top-p, ~5 % invalid
draft ids, plus a synthetic-acceptance pass per (V, mode). Both run on the same device with the same seeds;
a mismatch is a request whose tokens differ. Contract: mismatches < 1e-4 of decisions (target rows).

    python bench/rejection_sampler_grid.py --out bench/results/rejection_sampler_grid.json
"""

import argparse
import itertools
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_rejection_sampler import count_mismatches, make_batch  # noqa: E402

BATCHES, MAX_KS, MODES = (1, 8, 32, 128), (0, 1, 2, 4, 8), ("none", "dense", "sparse")
VOCABS = (100, 8193, 49152, 128256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seeds", type=int, default=2, help="batches per grid point")
    parser.add_argument("--vocabs", type=int, nargs="*", default=list(VOCABS))
    args = parser.parse_args()

    rows, total_m, total_d, start = [], 0, 0, time.time()
    points = itertools.product(args.vocabs, MODES, BATCHES, MAX_KS)
    for V, mode, B, max_k in points:
        m = d = 0
        for seed in range(args.seeds):
            batch = make_batch(B, V, max_k, mode, seed=1000 * seed + B + max_k, filter_frac=0.4, K=32,
                               device=args.device)
            bm, bd = count_mismatches(batch)
            m, d = m + bm, d + bd
        rows.append(dict(V=V, mode=mode, B=B, max_k=max_k, mismatches=m, decisions=d))
        total_m, total_d = total_m + m, total_d + d
    for V, mode in itertools.product(args.vocabs, MODES):
        batch = make_batch(64, V, 4, mode, seed=7, synthetic=True, K=32, device=args.device)
        m, d = count_mismatches(batch)
        rows.append(dict(V=V, mode=mode, B=64, max_k=4, synthetic=True, mismatches=m, decisions=d))
        total_m, total_d = total_m + m, total_d + d

    print(f"{'V':>7} {'mode':>7} {'B':>4} {'k':>2} {'mismatch':>8} {'rows':>6}")
    for r in rows:
        if r["mismatches"] or r["B"] == 128:
            print(f"{r['V']:>7} {r['mode']:>7} {r['B']:>4} {r['max_k']:>2} {r['mismatches']:>8} "
                  f"{r['decisions']:>6}" + ("  synthetic" if r.get("synthetic") else ""))
    rate = total_m / max(total_d, 1)
    print(f"total: {total_m} mismatching requests in {total_d} decisions (rate {rate:.2e}; contract < 1e-4), "
          f"{time.time() - start:.0f} s")
    summary = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                   torch=torch.__version__, mismatches=total_m, decisions=total_d, rate=rate,
                   passed=rate < 1e-4, points=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    sys.exit(0 if rate < 1e-4 else 1)


if __name__ == "__main__":
    main()
