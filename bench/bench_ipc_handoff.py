"""Can a drafter process queue its drafting behind a verifier process's sampler on the GPUs, with no host
wait in between, and what would a round cost? A prototype of the hand-off, two processes on two GPUs:

- "host" (what the services do today): the verifier runs its step, waits for it on the host, sends a message;
  the drafter copies the verifier's output to its GPU, drafts, waits on the host, answers; the verifier
  copies the drafts over and starts the next step.
- "device": the verifier queues its step, records an interprocess CUDA event and sends the message at once;
  the drafter makes its stream wait for that event, queues the copy and its drafting, records an event of
  its own and answers at once; the verifier queues a wait for the drafter's event and the next step behind
  it. The host of each side never waits for its GPU inside the round. "device" opens each event on the GPU
  that records it; "device_waiter" on the GPU of the stream that waits for it (a run of session 32 had the
  drafter process crash in "device").
- "flag" (specwire/stream_values.py): the verifier messages the drafter *before* it queues its step, and
  its stream writes the round's number into a slot of host memory both map behind the step; the drafter
  queues a wait for that number and its drafting at once, waits for its drafts on the host and answers (as
  the services do).

The step and the drafting are matmul loops sized by --verify-ms / --draft-ms. A counter rides the data
through both processes (each round adds 1 on each side) and is checked at the end, so a missed wait (a
step reading a buffer before the other process wrote it) shows as a wrong count, not a fast time.

    python bench/bench_ipc_handoff.py --rounds 500 --out bench/results/session32/ipc_handoff_h200x2.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import time

import torch

from specwire.stream_values import HostSlot, wait_value, write_value

SIDE = 4096  # a bf16 matmul of this side is a few tenths of a millisecond: few launches a round


def work_matrix(device: torch.device) -> torch.Tensor:
    return torch.randn(SIDE, SIDE, device=device, dtype=torch.bfloat16)


def busy(x: torch.Tensor, iters: int) -> None:
    out = torch.empty_like(x)
    for _ in range(iters):
        torch.mm(x, x, out=out)


def iterations_for(ms: float, device: torch.device) -> int:
    x = work_matrix(device)
    busy(x, 3)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    busy(x, 20)
    torch.cuda.synchronize(device)
    return max(1, round(ms / (1e3 * (time.perf_counter() - start) / 20)))


def drafter(conn, mode: str, rounds: int, draft_ms: float) -> None:
    faulthandler.enable()  # a crash in CUDA's IPC calls names its Python line
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    iters = iterations_for(draft_ms, device)
    work = work_matrix(device)
    out = torch.zeros(8, dtype=torch.int64, device=device)  # "drafts": the counter in out[0]
    done = torch.cuda.Event(interprocess=True)
    conn.send((out.untyped_storage()._share_cuda_(), bytes(done.ipc_handle())))
    shared, handle, slot_path = conn.recv()  # the verifier's output buffer, its event and its slot
    verified = mapped(shared, 8, "cuda:1")
    slot = HostSlot(slot_path)
    if mode not in FLAG_MODES:
        verifier_done = torch.cuda.Event.from_ipc_handle(device if mode == "device_waiter" else
                                                         torch.device("cuda:1"), handle)
    stream = torch.cuda.current_stream(device)
    for _ in range(rounds):
        seq = conn.recv()
        if mode in FLAG_MODES:
            wait_value(slot, seq, stream)
        elif mode != "host":
            stream.wait_event(verifier_done)
        out.copy_(verified)  # over NVLink
        busy(work, iters)
        out[0] += 1
        done.record()
        if mode == "host" or mode in FLAG_MODES:
            done.synchronize()
        conn.send(0)
    conn.recv()


def mapped(shared: tuple, n: int, device: str) -> torch.Tensor:
    """n int64 of another process's GPU memory (what _share_cuda_ gave)."""
    return torch.empty(0, dtype=torch.int64, device=device).set_(
        torch.UntypedStorage._new_shared_cuda(*shared), 0, (n,), (1,))


def answer(conn, child: mp.Process):
    """The drafter's next message; raises if it does not come (its traceback is on stderr)."""
    if not conn.poll(30):
        raise RuntimeError(f"the drafter process sent nothing for 30 s (exit code {child.exitcode})")
    return conn.recv()


FLAG_MODES = ("flag",)
# device_waiter: each side opens the other's event on its own GPU ("device", on the GPU that records it,
# crashed the drafter in torch 2.11: --modes)
MODES = ("host", "device_waiter", *FLAG_MODES) * 2


def one_run(mode: str, rounds: int, iters: int, draft_ms: float) -> dict:
    device = torch.device("cuda:1")
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=drafter, args=(theirs, mode, rounds, draft_ms))
    child.start()
    slot = HostSlot()
    try:
        work = work_matrix(device)
        out = torch.zeros(8, dtype=torch.int64, device=device)
        done = torch.cuda.Event(interprocess=True)
        shared, handle = answer(ours, child)
        drafts = mapped(shared, 8, "cuda:0")
        if mode not in FLAG_MODES:
            drafter_done = torch.cuda.Event.from_ipc_handle(device if mode == "device_waiter" else
                                                            torch.device("cuda:0"), handle)
        ours.send((out.untyped_storage()._share_cuda_(), bytes(done.ipc_handle()), slot.path))
        stream = torch.cuda.current_stream(device)
        start = time.perf_counter()
        for seq in range(1, rounds + 1):
            if mode in FLAG_MODES:  # told before the step is queued
                ours.send(seq)
            busy(work, iters)  # the verification
            out.copy_(drafts)  # the last round's drafts (zeros at first)
            out[0] += 1
            if mode in FLAG_MODES:
                write_value(slot, seq, stream)
            else:
                done.record()
                if mode == "host":
                    done.synchronize()
                ours.send(seq)
            answer(ours, child)
            if mode not in FLAG_MODES and mode != "host":
                stream.wait_event(drafter_done)
        out.copy_(drafts)
        torch.cuda.synchronize(device)
        ms = 1e3 * (time.perf_counter() - start) / rounds
        ours.send(None)
        child.join()
        return {"round_ms": ms, "count": int(out[0]), "expected": 2 * rounds}
    finally:
        if child.is_alive():
            child.kill()
        slot.unlink()
        slot.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--verify-ms", type=float, default=1.0)
    p.add_argument("--draft-ms", type=float, default=0.3)
    p.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda:1")
    torch.cuda.set_device(device)
    iters = iterations_for(args.verify_ms, device)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": args.rounds,
              "verify_ms": args.verify_ms, "draft_ms": args.draft_ms, "verify_matmuls": iters, "modes": {}}
    for mode in args.modes:
        try:
            run = one_run(mode, args.rounds, iters, args.draft_ms)
        except RuntimeError as e:  # a drafter that died: the other modes still run
            run = {"error": str(e)}
        result["modes"].setdefault(mode, []).append(run)
        print(mode, run, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
