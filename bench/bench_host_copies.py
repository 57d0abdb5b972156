"""What the small per-round host <-> device copies cost on a GPU host, each way of doing them side by side.

A two-process batch-1 round of SmolLM2 (bench/results/session32/) spends 0.37 ms of the drafter's time
between taking a step and starting on it, in the gather of the step's feature rows from the verifier's
shared table (a pinned upload of the row numbers, an index_select on the verifier's GPU, a copy to the
drafter's), and the speculative verifier 0.25 ms more than target-only before its forward is queued (the
feature store's write: a pinned upload of (slot, position) pairs and an index_put). Timed here, per call,
from the host until the result is usable on the destination stream (a synchronize), median of --repeats:

- upload: `specwire.staging.upload` (pin_memory per call) against a reused pinned buffer; read_back (a
  pinned buffer and an event per call) against a reused Readback and `.tolist()`;
- store_write: FeatureStore.write's index_put against an index_copy_ through a reused pinned buffer;
- gather (two GPUs; the table mapped from a second process as a drafter maps it): index_select on the
  table's GPU then a copy, against a copy of the contiguous rows (one request's rows are contiguous).

    python bench/bench_host_copies.py --out bench/results/session32/host_copies_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from specwire.staging import Readback, read_back, upload


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median µs of fn() followed by a synchronize of `device`."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def host_side(repeats: int) -> dict[str, float]:
    device = torch.device("cuda:0")
    out = {}
    values = list(range(8))
    pinned = torch.empty(64, dtype=torch.int64, pin_memory=True)
    target = torch.empty(64, dtype=torch.int64, device=device)

    def reused() -> torch.Tensor:
        pinned.numpy()[:8] = values
        return target[:8].copy_(pinned[:8], non_blocking=True)

    out["upload_pin_memory_us"] = timed(lambda: upload(torch.tensor(values), device), repeats, device)
    out["upload_reused_pinned_us"] = timed(reused, repeats, device)
    out["tensor_to_sync_us"] = timed(lambda: torch.tensor(values).to(device), repeats, device)
    drafts = torch.arange(8, device=device)
    readback = Readback()
    out["read_back_new_buffer_us"] = timed(lambda: read_back(drafts), repeats, device)
    out["read_back_reused_us"] = timed(lambda: (readback.start(drafts), readback.wait()), repeats, device)
    out["tolist_us"] = timed(drafts.tolist, repeats, device)
    # FeatureStore.write for 5 fed tokens at SmolLM2's features (3 x 576 bf16), store 64 slots x 1024
    width, context = 3 * 576, 1024
    rows = torch.zeros(64, context, width, dtype=torch.bfloat16, device=device)
    table = torch.randn(5, width, dtype=torch.bfloat16, device=device)
    slots, positions = [3] * 5, [100, 101, 102, 103, 104]

    def index_put() -> None:
        where = upload(torch.tensor([slots, positions]), device)
        rows[where[0], where[1]] = table

    def index_copy() -> None:
        cells = pinned.numpy()
        cells[:5] = np.asarray(slots) * context + np.asarray(positions)
        index = target[:5].copy_(pinned[:5], non_blocking=True)
        rows.view(-1, width).index_copy_(0, index, table)

    out["store_write_index_put_us"] = timed(index_put, repeats, device)
    out["store_write_index_copy_us"] = timed(index_copy, repeats, device)
    return out


def _verifier(conn) -> None:
    from specwire.shared_features import describe
    table = torch.randn(64 * 1024, 3 * 576, dtype=torch.bfloat16, device="cuda:1")
    conn.send(describe(table).SerializeToString())
    conn.recv()  # hold the table until the drafter is done


def gather(repeats: int) -> dict[str, float]:
    from specwire.shared_features import open_table
    from specwire.v1 import drafter_pb2 as pb
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    verifier = ctx.Process(target=_verifier, args=(theirs,))
    verifier.start()
    table = open_table(pb.SharedFeatures.FromString(ours.recv()))
    drafter = torch.device("cuda:0")
    torch.cuda.set_device(drafter)
    out = {}
    for n_refs, n_rows in ((1, 3), (16, 2)):
        firsts = np.arange(n_refs) * 1024 + 100
        counts = np.full(n_refs, n_rows)
        dst = torch.empty(n_refs * n_rows, table.shape[1], dtype=table.dtype, device=drafter)

        def index_select(firsts=firsts, counts=counts) -> torch.Tensor:
            rows = np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
            return table.index_select(0, upload(torch.from_numpy(rows), table.device)).to(drafter)

        def slices(firsts=firsts, counts=counts, dst=dst) -> None:
            at = 0
            for first, n in zip(firsts.tolist(), counts.tolist(), strict=True):
                dst[at:at + n].copy_(table[first:first + n], non_blocking=True)
                at += n

        out[f"gather_index_select_{n_refs}x{n_rows}_us"] = timed(index_select, repeats, drafter)
        out[f"gather_slices_{n_refs}x{n_rows}_us"] = timed(slices, repeats, drafter)
    ours.send("done")
    verifier.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, **host_side(args.repeats)}
    if torch.cuda.device_count() > 1:
        result.update(gather(args.repeats))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
