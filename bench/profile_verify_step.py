"""Why a verification step in the services takes longer than the engine's own decode step (GPU).

Times, per batch size, the engine's steps as the verifier's worker thread runs them (forward, then the
rejection sampler and the one copy back of its tokens), split into forward and sampler, for a decode step
(1 token per row) and a verify step (1 + k tokens per row):
  quiet   nothing else runs in the process;
  gil     a second Python thread runs pure-Python work all the time (an event loop that never sleeps: the
          worst case of the verifier's asyncio thread), at the default switch interval (5 ms);
  gil_si  the same with sys.setswitchinterval(--switch-interval).
A step that waits on the device releases the GIL; taking it back while another thread computes costs up
to a switch interval. Then a torch.profiler table of one verify step's kernels.

    python bench/profile_verify_step.py --model synthetic:llama-3.1-8b --out bench/results/verify_step_8b.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time

import torch
from specwire.drafter.train_eagle import code_commit
from specwire.kernels.rejection_sampler import rejection_sample

from specwire.engine import TargetEngine


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--switch-interval", type=float, default=2e-4)
    p.add_argument("--out", default=None)
    return p.parse_args()


class Busy:
    """A thread running pure-Python work until stopped."""

    def __init__(self):
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        x = 0
        while not self.stop:
            for i in range(1000):
                x += i

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def sample(logits: torch.Tensor, batch: int, k: int) -> list[list[int]]:
    """The verifier's sampler call (greedy, one-hot drafts), tokens read back once."""
    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    out = rejection_sample(
        logits, column([7] * (batch * k), torch.int64), column([k] * batch, torch.int32), None,
        column([0.0] * batch, torch.float32), column([0] * batch, torch.int32),
        column([1.0] * batch, torch.float32), column([1] * batch, torch.int64),
        column([64] * batch, torch.int64), defer_check=True)
    return out.token_lists()


def timed(fn, iters: int) -> float:
    """Median ms of fn() over iters calls (fn ends with a host read of a device result)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def steps(engine: TargetEngine, batch: int, k: int) -> dict:
    slots, starts = list(range(batch)), [64] * batch

    def decode_forward():
        engine.decode(slots, [5] * batch, starts).logits[:1, :1].cpu()

    def decode_step():
        sample(engine.decode(slots, [5] * batch, starts).logits, batch, 0)

    def verify_forward():
        engine.verify(slots, [[5] * (k + 1)] * batch, starts).logits[:1, :1].cpu()

    def verify_step():
        sample(engine.verify(slots, [[5] * (k + 1)] * batch, starts).logits, batch, k)

    return {"decode_forward": decode_forward, "decode_step": decode_step, "verify_forward": verify_forward,
            "verify_step": verify_step}


def kernel_table(fn) -> str:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)


def main() -> int:
    args = parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = TargetEngine(args.model, device=args.device, max_slots=max(batches), max_context=512,
                          max_verify_tokens=args.k + 1)
    torch.set_grad_enabled(False)
    for slot in range(max(batches)):
        engine.prefill([(slot, list(range(3, 67)))])
    torch.cuda.synchronize()
    default_si = sys.getswitchinterval()
    results = []
    for batch in batches:
        fns = steps(engine, batch, args.k)
        row = {"batch": batch, "k": args.k}
        for mode in ("quiet", "gil", "gil_si"):
            sys.setswitchinterval(args.switch_interval if mode == "gil_si" else default_si)
            if mode == "quiet":
                row[mode] = {name: timed(fn, args.iters) for name, fn in fns.items()}
            else:
                with Busy():
                    row[mode] = {name: timed(fn, args.iters) for name, fn in fns.items()}
        sys.setswitchinterval(default_si)
        row["verify_kernels"] = kernel_table(fns["verify_step"])
        row["decode_kernels"] = kernel_table(fns["decode_step"])
        results.append(row)
        print(json.dumps({key: v for key, v in row.items() if not key.endswith("kernels")}, indent=1))
        print(row["verify_kernels"])
    report = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
        "switch_interval_default_s": default_si, "switch_interval_s": args.switch_interval,
        "commit": code_commit(),
        "units": "ms, median per call", "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
