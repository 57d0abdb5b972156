"""Soak: a real `specwire drafter` and `specwire verifier` (default model, shipped head, CPU) under random
traffic for --seconds: requests arrive at random, some are cancelled by the client, some run into their
deadline (specwire.soak). Afterwards both services must hold no request and no KV slot, every request must
have ended exactly once with tokens equal to target-only greedy output (or a prefix of it when cut short),
and resident memory (VmRSS of each process, sampled every --sample-seconds) must stay flat.

    python bench/soak.py --seconds 600 --out bench/results/soak_cpu.json

Exits 1 when anything was lost, duplicated, wrong or left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from specwire.commands.demo import free_port, start, stop, wait_drafter_connected, wait_serving
from specwire.soak import SoakConfig, problems, run_soak, tally

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn rain.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a recipe for a quick breakfast.",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do?",
    "Summarise the rules of chess in one paragraph.",
)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


class RssSampler(threading.Thread):
    """Samples each process's resident memory every `interval` seconds: [(t, {name: MB}), ...]."""

    def __init__(self, pids: dict[str, int], interval: float):
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopping.is_set():
            t = time.monotonic() - self.start_time
            rss = {name: round(rss_mb(pid), 1) for name, pid in self.pids.items()}
            self.samples.append((round(t, 1), rss))
            self.stopping.wait(self.interval)


def flatness(samples: list[tuple[float, dict[str, float]]], name: str, warmup: float) -> dict:
    """How flat one process's RSS stayed after `warmup` seconds: range, first/last-minute medians, slope."""
    steady = [(t, s[name]) for t, s in samples if t >= warmup]
    ts, mb = [t for t, _ in steady], [v for _, v in steady]
    first = [v for t, v in steady if t < ts[0] + 60]
    last = [v for t, v in steady if t > ts[-1] - 60]
    mean_t, mean_mb = statistics.fmean(ts), statistics.fmean(mb)
    slope = sum((t - mean_t) * (v - mean_mb) for t, v in steady) / sum((t - mean_t) ** 2 for t in ts)
    head, tail = statistics.median(first), statistics.median(last)
    return {"samples": len(steady), "min_mb": min(mb), "max_mb": max(mb),
            "range_mb": round(max(mb) - min(mb), 1),
            "first_minute_median_mb": head, "last_minute_median_mb": tail, "growth_mb": round(tail - head, 1),
            "slope_mb_per_minute": round(slope * 60, 3)}


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def idle_state(metrics: dict[str, int]) -> dict[str, float]:
    v, d = scrape(metrics["verifier"]), scrape(metrics["drafter"])
    return {"verifier_kv_slots_used": v['specwire_kv_slots{state="used"}'],
            "verifier_running": v["specwire_num_requests_running"],
            "verifier_waiting": v["specwire_num_requests_waiting"],
            "drafter_requests": d["specwire_drafter_num_requests"]}


def references(max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-templated prompt ids and their target-only greedy output (in-process engine, no services)."""
    from specwire.engine import TargetEngine
    from specwire.sampling_params import SamplingParams

    engine = TargetEngine(None, "cpu", None, max_slots=1)
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return ids, [r.token_ids for r in engine.generate(ids, [params] * len(ids))]


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + ("+dirty" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--arrivals-per-second", type=float, default=1.0)
    p.add_argument("--max-in-flight", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--sample-seconds", type=float, default=5.0)
    p.add_argument("--warmup-seconds", type=float, default=60.0, help="RSS flatness is judged after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args()

    prompt_ids, refs = references(args.max_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-soak-"))
    metrics = {"drafter": free_port(), "verifier": free_port()}
    drafter = start("drafter", ["drafter", "--device", "cpu", "--metrics-port", str(metrics["drafter"])],
                    log_dir)
    verifier = start("verifier", ["verifier", "--device", "cpu", "--k", str(args.k),
                                  "--metrics-port", str(metrics["verifier"]),
                                  "--drafter", f"127.0.0.1:{drafter.port}"], log_dir)
    try:
        wait_serving([drafter, verifier], timeout=300)
        if not wait_drafter_connected(verifier.port, 60):
            raise SystemExit("the verifier never connected to the drafter")
        sampler = RssSampler({"verifier": verifier.process.pid, "drafter": drafter.process.pid},
                             args.sample_seconds)
        sampler.start()
        config = SoakConfig(seconds=args.seconds, arrivals_per_second=args.arrivals_per_second,
                            max_in_flight=args.max_in_flight, min_tokens=4, max_tokens=args.max_tokens,
                            seed=args.seed)
        started = time.monotonic()
        outcomes = asyncio.run(run_soak(f"127.0.0.1:{verifier.port}", prompt_ids, config))
        traffic_seconds = time.monotonic() - started
        deadline = time.monotonic() + 60
        while any(idle_state(metrics).values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2 * args.sample_seconds)  # a last RSS sample or two at rest
        sampler.stopping.set()
        sampler.join()
        idle = idle_state(metrics)
        final = scrape(metrics["verifier"])
    finally:
        stop([verifier, drafter])
        shutil.rmtree(log_dir, ignore_errors=True)

    found = problems(outcomes, refs)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()} ({os.cpu_count()} CPUs, {platform.platform()})",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "config": {**config.__dict__, "k": args.k, "prompts": len(PROMPTS),
                   "sample_seconds": args.sample_seconds},
        "traffic_seconds": round(traffic_seconds, 1),
        "tally": tally(outcomes),
        "problems": found,
        "idle_after": idle,
        "speculation": {key: final.get(f"specwire_spec_decode_num_{key}_total")
                        for key in ("drafts", "draft_tokens", "accepted_tokens")},
        "fallback_steps": {k: v for k, v in final.items() if k.startswith("specwire_fallback_steps_total")},
        "rss": {name: flatness(sampler.samples, name, args.warmup_seconds)
                for name in ("verifier", "drafter")},
        "rss_samples": sampler.samples,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("tally", "problems", "idle_after", "rss")}, indent=1))
    return 1 if found or any(idle.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
