"""The host time of one target-only round's launches, on one thread with nothing beside it: the engine's
decode step (inputs staged, CUDA graph replayed) and the rejection sampler's launch, then the tokens read
back. Each is timed on the host (perf_counter, no synchronisation inside), once straight after the other as
the scheduler runs them ("chained") and once with the device idle before each ("synced"): a launch that
takes longer chained than synced waits for the device somewhere inside. Beside them, in the same rounds (so
that the host's drift between processes cancels): the sampler launched with its per-request columns prepared
once ("sampler_columns", as the scheduler runs it since session 43), and the launch-ahead's feed of the next
rows from the sampler's output, one Triton launch against its torch reference ("follow" / "follow_ref").

    python bench/bench_launch_host.py --model /root/m/smol.gguf --batch 1,16,64 --out launch_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from specwire.kernels.ops import follow_sampler, follow_sampler_ref
from specwire.kernels.rejection_sampler import prepare_columns, rejection_sample, sample_with

from specwire.engine import TargetEngine, device_and_dtype
from specwire.model_source import load_model


def columns(batch: int, k: int, positions: list[int]) -> list[np.ndarray | None]:
    """The sampler's arguments as the scheduler builds them for greedy rows of k drafts each."""
    return [np.full(batch * k, 7, np.int64), np.full(batch, k, np.int32), None, np.zeros(batch, np.float32),
            np.zeros(batch, np.int32), np.ones(batch, np.float32), np.arange(batch, dtype=np.int64),
            np.array(positions, np.int64)]


def rounds(engine: TargetEngine, batch: int, k: int, n: int, synced: bool) -> dict[str, float]:
    """Median host ms of each part of n rounds: k = 0 decode steps, else verifications of k drafts (each
    round's rows start one token further on: the times, not the tokens, are what is measured)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    slots = [engine.allocate_slot() for _ in range(batch)]
    tokens = engine.prefill([(s, [1, 2, 3, 4]) for s in slots]).logits.argmax(-1).tolist()
    position = 4
    times: dict[str, list[float]] = {"decode": [], "sampler": [], "sampler_columns": [], "follow": [],
                                     "follow_ref": [], "tokens": [], "round": []}
    host = columns(batch, k, [position] * batch)
    prepared = prepare_columns(host[1], *host[3:7], engine.config.vocab_size, engine.device)
    ids = torch.zeros(batch, k + 1, dtype=torch.int64, device=engine.device)
    starts = torch.zeros(batch, dtype=torch.int32, device=engine.device)
    for i in range(n):
        if synced:
            sync()
        t0 = time.perf_counter()
        if k:
            out = engine.verify(slots, [[t, *[7] * k] for t in tokens], [position] * batch, None, [])
        else:
            out = engine.decode(slots, tokens, [position] * batch)
        t1 = time.perf_counter()
        if synced:
            sync()
        t1s = time.perf_counter()
        sampled = rejection_sample(out.logits, *columns(batch, k, [position + 1] * batch), defer_check=True)
        t2 = time.perf_counter()
        # Only drafts and positions are built each round, as the scheduler does with its columns prepared
        drafts, positions = np.full(batch * k, 7, np.int64), np.full(batch, position + 1, np.int64)
        sample_with(prepared, out.logits, drafts, None, positions, defer_check=True)
        t2c = time.perf_counter()
        follow_sampler(ids, starts, sampled.packed, engine.config.vocab_size)
        t2f = time.perf_counter()
        follow_sampler_ref(ids, starts, sampled.packed, engine.config.vocab_size)
        t2r = time.perf_counter()
        tokens = [row[0] for row in sampled.token_lists()]
        t3 = time.perf_counter()
        position += 1
        if i >= 10:  # past the first rounds' allocations
            times["decode"].append(t1 - t0)
            times["sampler"].append(t2 - t1s)
            times["sampler_columns"].append(t2c - t2)
            times["follow"].append(t2f - t2c)
            times["follow_ref"].append(t2r - t2f)
            times["tokens"].append(t3 - t2r)
            times["round"].append(t2 - t0 + t3 - t2r)  # the round as the scheduler runs it
    for s in slots:
        engine.free_slot(s)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--k", type=int, default=4, help="drafts a row in the verification rounds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device, dtype = device_and_dtype(args.device, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config, state_dict, _, name = load_model(args.model, device, dtype)
    batches = [int(b) for b in args.batch.split(",")]
    engine = TargetEngine(device=device, dtype=dtype, max_slots=max(batches), max_context=512,
                          checkpoint=(config, state_dict), max_verify_tokens=args.k + 1)
    results = []
    for k in (0, args.k):
        for batch in batches:
            for synced in (False, True):
                r = rounds(engine, batch, k, args.rounds, synced)
                results.append({"k": k, "batch": batch, "synced": synced, "median_ms": r})
                print(f"k {k} batch {batch:3d} {'synced ' if synced else 'chained'}: "
                      + ", ".join(f"{part} {ms:.3f} ms" for part, ms in r.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            json.dump({"bench": "bench_launch_host", "model": name, "device": gpu, "argv": sys.argv,
                       "torch": torch.__version__, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
