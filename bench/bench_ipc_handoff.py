"""Can a drafter process queue its drafting behind a verifier process's sampler on the GPUs, with no host
wait in between, and what would a round cost? A prototype of the hand-off, two processes on two GPUs:

- "host" (what the services do today): the verifier runs its step, waits for it on the host, sends a message;
  the drafter copies the verifier's output to its GPU, drafts, waits on the host, answers; the verifier
  copies the drafts over and starts the next step.
- "device": the verifier queues its step, records an interprocess CUDA event and sends the message at once;
  the drafter makes its stream wait for that event, queues the copy and its drafting, records an event of
  its own and answers at once; the verifier queues a wait for the drafter's event and the next step behind
  it. The host of each side never waits for its GPU inside the round.

The step and the drafting are matmul loops sized by --verify-ms / --draft-ms. A counter rides the data
through both processes (each round adds 1 on each side) and is checked at the end, so a missed wait (a
step reading a buffer before the other process wrote it) shows as a wrong count, not a fast time.

    python bench/bench_ipc_handoff.py --rounds 500 --out bench/results/session32/ipc_handoff_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch


def busy(x: torch.Tensor, iters: int) -> None:
    for _ in range(iters):
        torch.mm(x, x, out=x)
        x.mul_(1e-3)  # keep it finite


def iterations_for(ms: float, device: torch.device) -> int:
    x = torch.randn(1024, 1024, device=device) * 1e-3
    busy(x, 10)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    busy(x, 100)
    torch.cuda.synchronize(device)
    return max(1, round(ms / (1e3 * (time.perf_counter() - start) / 100)))


def drafter(conn, mode: str, rounds: int, draft_ms: float) -> None:
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    iters = iterations_for(draft_ms, device)
    work = torch.randn(1024, 1024, device=device) * 1e-3
    out = torch.zeros(8, dtype=torch.int64, device=device)  # "drafts": the counter in out[0]
    done = torch.cuda.Event(interprocess=True)
    conn.send((out.untyped_storage()._share_cuda_(), bytes(done.ipc_handle())))
    shared, handle = conn.recv()  # the verifier's output buffer and its event
    verified = torch.empty(0, dtype=torch.int64, device="cuda:1").set_(
        torch.UntypedStorage._new_shared_cuda(*shared), 0, (8,), (1,))
    verifier_done = torch.cuda.Event.from_ipc_handle(torch.device("cuda:1"), handle)
    for _ in range(rounds):
        conn.recv()
        if mode == "device":
            torch.cuda.current_stream(device).wait_event(verifier_done)
        out.copy_(verified)  # over NVLink
        busy(work, iters)
        out[0] += 1
        done.record()
        if mode == "host":
            done.synchronize()
        conn.send(0)
    conn.recv()


def answer(conn, child: mp.Process):
    """The drafter's next message; raises if it does not come (its traceback is on stderr)."""
    if not conn.poll(30):
        raise RuntimeError(f"the drafter process sent nothing for 30 s (exit code {child.exitcode})")
    return conn.recv()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--verify-ms", type=float, default=1.0)
    p.add_argument("--draft-ms", type=float, default=0.3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda:1")
    torch.cuda.set_device(device)
    iters = iterations_for(args.verify_ms, device)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": args.rounds,
              "verify_ms": args.verify_ms, "draft_ms": args.draft_ms}
    for mode in ("host", "device", "host", "device"):
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=drafter, args=(theirs, mode, args.rounds, args.draft_ms))
        child.start()
        work = torch.randn(1024, 1024, device=device) * 1e-3
        out = torch.zeros(8, dtype=torch.int64, device=device)
        done = torch.cuda.Event(interprocess=True)
        shared, handle = answer(ours, child)
        drafts = torch.empty(0, dtype=torch.int64, device="cuda:0").set_(
            torch.UntypedStorage._new_shared_cuda(*shared), 0, (8,), (1,))
        drafter_done = torch.cuda.Event.from_ipc_handle(torch.device("cuda:0"), handle)
        ours.send((out.untyped_storage()._share_cuda_(), bytes(done.ipc_handle())))
        start = time.perf_counter()
        for _ in range(args.rounds):
            busy(work, iters)  # the verification
            out.copy_(drafts)  # the last round's drafts (zeros at first)
            out[0] += 1
            done.record()
            if mode == "host":
                done.synchronize()
            ours.send(0)
            answer(ours, child)
            if mode == "device":
                torch.cuda.current_stream(device).wait_event(drafter_done)
        out.copy_(drafts)
        torch.cuda.synchronize(device)
        ms = 1e3 * (time.perf_counter() - start) / args.rounds
        count = int(out[0])
        ours.send(None)
        child.join()
        result.setdefault(mode, []).append({"round_ms": ms, "count": count, "expected": 2 * args.rounds})
        print(mode, f"{ms:.3f} ms a round, counter {count} (expected {2 * args.rounds})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
