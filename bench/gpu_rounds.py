"""Each GPU's side of a round, from a torch.profiler trace of the verifier (specwire/step_profiler.py: the
services run with SPECWIRE_PROFILE_DIR set). With the drafter co-located on another GPU, one trace holds
both devices' kernels.

A verification is a stretch of kernels on the verifier's device longer than --min-ms with no gap over 30 us
between them; per round (one verification's start to the next one's) this prints the verification's span,
the verifier device's idle gap after it, and the drafter device's busy time and the offsets of its first and
last kernel from the verification's end (negative: while it ran). --window START END lists one device's
kernels between two trace times (ms from the trace's first kernel) with the gaps between them.

    python bench/gpu_rounds.py verifier-668.json.gz --verifier-device 1 --drafter-device 0
    python bench/gpu_rounds.py verifier-668.json.gz --window 303.6 305.0 --device 0
"""

from __future__ import annotations

import argparse
import gzip
import json


def kernels(path: str) -> list[dict]:
    """The trace's device events (kernels, copies, sets) by start; ts and dur in us, ts from the first."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("args", {}).get("device") is not None]
    out.sort(key=lambda e: e["ts"])
    first = out[0]["ts"]
    return [{"ts": e["ts"] - first, "dur": e["dur"], "device": e["args"]["device"], "name": e["name"]}
            for e in out]


def stretches(events: list[dict], device: int, max_gap_us: float = 30.0) -> list[tuple[float, float]]:
    """(start, end) of the runs of `device`'s kernels with no gap over max_gap_us between them."""
    out: list[list[float]] = []
    for e in events:
        if e["device"] != device:
            continue
        if out and e["ts"] - out[-1][1] < max_gap_us:
            out[-1][1] = max(out[-1][1], e["ts"] + e["dur"])
        else:
            out.append([e["ts"], e["ts"] + e["dur"]])
    return [(a, b) for a, b in out]


def rounds(events: list[dict], verifier: int, drafter: int, min_ms: float) -> list[dict]:
    verifications = [s for s in stretches(events, verifier) if s[1] - s[0] > min_ms * 1000]
    out = []
    for (start, end), (next_start, _) in zip(verifications, verifications[1:], strict=False):
        drafts = [e for e in events if e["device"] == drafter and start <= e["ts"] < next_start]
        out.append({
            "start_ms": start / 1000, "verify_ms": (end - start) / 1000,
            "round_ms": (next_start - start) / 1000,
            "verifier_idle_after_ms": (next_start - end) / 1000,
            "drafter_busy_ms": sum(e["dur"] for e in drafts) / 1000,
            "drafter_last_after_verify_ms": (max(e["ts"] + e["dur"] for e in drafts) - end) / 1000
            if drafts else None,
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a step profiler's Chrome trace (.json or .json.gz)")
    p.add_argument("--verifier-device", type=int, default=1)
    p.add_argument("--drafter-device", type=int, default=0)
    p.add_argument("--min-ms", type=float, default=3.0, help="shortest stretch taken for a verification")
    p.add_argument("--window", type=float, nargs=2, metavar=("START", "END"), help="list kernels (ms)")
    p.add_argument("--device", type=int, default=0, help="the device --window lists")
    args = p.parse_args()
    events = kernels(args.trace)
    if args.window:
        lo, hi, last = args.window[0] * 1000, args.window[1] * 1000, None
        for e in events:
            if e["device"] == args.device and lo <= e["ts"] < hi:
                gap = 0.0 if last is None else e["ts"] - last
                print(f"{e['ts'] / 1000:9.3f} ms  +{gap:6.1f} us  {e['dur']:7.1f} us  {e['name'][:90]}")
                last = e["ts"] + e["dur"]
        return
    for r in rounds(events, args.verifier_device, args.drafter_device, args.min_ms):
        last = r["drafter_last_after_verify_ms"]
        last = "-" if last is None else f"{last:.3f}"
        print(f"at {r['start_ms']:8.2f} ms: verify {r['verify_ms']:.3f}, round {r['round_ms']:.3f}, "
              f"verifier idle after {r['verifier_idle_after_ms']:.3f}; drafter busy "
              f"{r['drafter_busy_ms']:.3f}, its last kernel ends {last} ms after the verification")


if __name__ == "__main__":
    main()
