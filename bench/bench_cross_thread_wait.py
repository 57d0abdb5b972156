"""How long one thread's device calls are held up while another thread of the process waits for the device.

The co-located verifier runs the drafter's table steps on a worker thread beside the loop that launches the
verification. Traced at the 8B shape (two GPUs, batch 1), the verification's feature write waited ~2 ms for
the drafter's thread, which was reading its tables back with `.tolist()`. Here: thread A queues ~60 ms of
work on GPU 0 and waits for it by one of WAYS; meanwhile thread B (its device GPU 1) runs a Python loop (the
GIL) or the feature store's write (a pinned upload, a copy GPU 1 -> GPU 0 and an index_put on GPU 0) and
times it. One GPU: both threads use cuda:0.

    python bench/bench_cross_thread_wait.py --out bench/results/cross_thread_wait_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from specwire.staging import read_back

WAYS = ("none", "tolist", "cpu", "read_back", "event")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    waiting = torch.device("cuda:0")
    writing = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    a = torch.randn(8192, 8192, device=waiting, dtype=torch.bfloat16)
    drafts = torch.zeros(64, 12, device=waiting, dtype=torch.long)
    table = torch.randn(16, 4 * 4096, device=writing, dtype=torch.bfloat16)  # a verification's features
    store = torch.empty(16, 1024, 3 * 4096, device=waiting, dtype=torch.bfloat16)  # FeatureStore.rows

    def write() -> None:  # FeatureStore.write for 5 fed tokens
        where = torch.tensor([[0] * 5, [1, 2, 3, 4, 5]]).pin_memory().to(waiting, non_blocking=True)
        store[where[0], where[1]] = table[:5, 4096:].to(waiting, store.dtype)

    def python_loop() -> None:
        sum(range(2000))

    def wait(way: str, done: list[float]) -> None:
        with torch.cuda.device(waiting):
            for _ in range(40):
                a @ a
            drafts.add_(1)
            if way == "tolist":
                drafts.tolist()
            elif way == "cpu":
                drafts.cpu()
            elif way == "read_back":
                read_back(drafts)
            elif way == "event":
                event = torch.cuda.Event()
                event.record()
                event.synchronize()
        done.append(time.perf_counter())

    results = []
    for name, fn in (("python_loop", python_loop), ("feature_store_write", write)):
        for way in WAYS:
            times, waits = [], []
            for _ in range(args.repeats + 1):  # the first, which allocates, is left out
                torch.cuda.synchronize(waiting)
                torch.cuda.synchronize(writing)
                done: list[float] = []
                other = threading.Thread(target=wait, args=(way, done)) if way != "none" else None
                if other:
                    other.start()
                    time.sleep(0.005)  # until the other thread waits
                start = time.perf_counter()
                with torch.cuda.device(writing):
                    fn()
                times.append((time.perf_counter() - start) * 1e3)
                if other:
                    other.join()
                    waits.append((done[0] - start) * 1e3)
            row = {"call": name, "other_thread_waits_by": way,
                   "ms_median": round(statistics.median(times[1:]), 3), "ms_max": round(max(times[1:]), 3),
                   "other_wait_ends_ms": round(statistics.median(waits[1:]), 2) if waits else None}
            results.append(row)
            print(json.dumps(row))
    report = {"bench": "cross_thread_wait", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "torch": torch.__version__, "devices": [torch.cuda.get_device_name(waiting),
                                                      torch.cuda.get_device_name(writing)],
              "waiting_device": str(waiting), "writing_device": str(writing), "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
