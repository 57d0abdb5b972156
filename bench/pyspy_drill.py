"""Where one thread's samples go under one function, from a py-spy raw profile (bench/profile_services.sh,
or `py-spy record --threads --idle --format raw`): the function's call sites one or more frames deeper,
by share of samples. A thread waiting for the GIL or the device is sampled at the line that waits, so
a line's share is the time the thread spent there, whatever it did.

    python bench/pyspy_drill.py pyspy.txt.gz --pid 2340 --thread engine --function _verify_on_worker
    python bench/pyspy_drill.py pyspy.txt.gz --pid 2340 --thread MainThread --function "_round (" --depth 2
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re


def drill(path: str, pid: str, thread: str, function: str, depth: int) -> tuple[int, collections.Counter]:
    sites: collections.Counter = collections.Counter()
    total = 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not any(frame.startswith(f"process {pid}:") for frame in frames):
                continue
            if thread not in next((frame for frame in frames if frame.startswith("thread ")), ""):
                continue
            at = next((i for i, frame in enumerate(frames) if function in frame), None)
            if at is None:
                continue
            total += int(count)
            below = [re.sub(r"\(/.*?([^/]+\.py)", r"(\1", frame) for frame in frames[at:at + 1 + depth]]
            sites[" > ".join(below)] += int(count)
    return total, sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("--pid", required=True, help="the process (py-spy's 'process N:' frame)")
    p.add_argument("--thread", required=True, help="a substring of the thread's name")
    p.add_argument("--function", required=True, help="a substring of the frame to drill into")
    p.add_argument("--depth", type=int, default=1, help="frames below it to tell call sites apart")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    total, sites = drill(args.profile, args.pid, args.thread, args.function, args.depth)
    print(f"{total} samples under {args.function!r}")
    for site, n in sites.most_common(args.top):
        print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {site}")


if __name__ == "__main__":
    main()
