"""Both services end to end over gRPC: tokens/s with speculation against a target-only verifier (k = 0) of the
same code, mean acceptance length, and greedy equality, at several batch sizes.

Drafter and verifiers run as real processes (the `specwire demo` plumbing); on a 2-GPU machine put the drafter
on one GPU and the verifiers on the other:

    python bench/bench_services.py --model /root/m/smol.gguf \
        --drafter-device cuda:0 --verifier-device cuda:1 --batch-sizes 1,16 --max-tokens 128 \
        --out bench/results/services_h200x2.json

Batch B sends B requests at once (fixed length: ignore_eos) and times them wall to wall; the target-only
verifier then gets the same B prompts. Greedy equality compares each prompt's tokens between the two; bf16
kernels that differ between a 1-token decode and a (1 + k)-token verify can make rare ties break apart, so
the rate is measured, not assumed.

Where a speculative round's time goes comes from the services' own Prometheus /metrics, scraped before and
after each batch size: per verification, the verifier's engine-thread time and the drafter round trip it
waited for, and the drafter's compute per DraftStep (means over the run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from specwire.drafter.cli import DEFAULT_HEAD

from specwire.commands.demo import (
    Totals,
    free_port,
    start,
    stop,
    stream,
    wait_drafter_connected,
    wait_serving,
)
from specwire.default_model import resolve_model_path

PROMPTS = [
    "Explain how a bicycle stays upright.", "Write a short poem about the sea.",
    "What is the capital of France and why is it famous?", "List three uses of a paperclip.",
    "Describe the water cycle in simple terms.", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.", "How do vaccines work?",
    "What are prime numbers? Give examples.",
    "Tell me a fun fact about octopuses.", "How does a compiler differ from an interpreter?",
    "Write a haiku about autumn leaves.", "What causes earthquakes?", "Explain photosynthesis to a child.",
    "Suggest a name for a small coffee shop.",
]


def run_batch(port: int, prompts: list[str], max_tokens: int) -> tuple[float, list[Totals]]:
    """(wall seconds, per-request totals) of all prompts sent at once."""
    totals = [Totals() for _ in prompts]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda i: stream(port, prompts[i], max_tokens, False, totals[i], ignore_eos=True),
                      range(len(prompts))))
    return time.perf_counter() - started, totals


# (name in the report, metric family, which service): histograms whose sum and count give a mean
BREAKDOWN = [("verify_step_ms", "specwire_verify_step_seconds", "verifier"),
             ("drafter_round_trip_ms", "specwire_drafter_rpc_latency_seconds", "verifier"),
             ("drafter_compute_ms", "specwire_drafter_step_seconds", "drafter")]


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics endpoint, by sample name (label-free samples only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def breakdown(before: dict[str, dict], after: dict[str, dict], seconds: float) -> dict[str, float]:
    """Mean ms of each BREAKDOWN histogram between two scrapes, and wall ms per verification."""
    def delta(service: str, sample: str) -> float:
        return after[service].get(sample, 0.0) - before[service].get(sample, 0.0)

    out = {}
    for name, family, service in BREAKDOWN:
        count = delta(service, family + "_count")
        out[name] = 1e3 * delta(service, family + "_sum") / count if count else 0.0
    steps = delta("verifier", "specwire_verify_step_seconds_count")
    out["wall_per_verification_ms"] = 1e3 * seconds / steps if steps else 0.0
    return out


def measure(port: int, prompts: list[str], batch: int, max_tokens: int, repeats: int) -> dict:
    seconds, tokens, drafts, accepted, outputs = 0.0, 0, 0, 0, []
    for r in range(repeats):
        chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
        wall, totals = run_batch(port, chosen, max_tokens)
        seconds += wall
        tokens += sum(t.tokens for t in totals)
        drafts += sum(t.drafts for t in totals)
        accepted += sum(t.accepted for t in totals)
        outputs += [t.outputs[0] for t in totals]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0, "outputs": outputs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--head", default=str(DEFAULT_HEAD))
    p.add_argument("--drafter-device", default=None)
    p.add_argument("--verifier-device", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="batches per batch size (default 2)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()

    model = str(resolve_model_path(args.model))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    slots = str(max(batch_sizes))

    def device(d: str | None) -> list[str]:
        return ["--device", d] if d else []

    logs = Path(tempfile.mkdtemp(prefix="specwire-bench-"))
    metrics_ports = {"drafter": free_port(), "verifier": free_port()}
    drafter = start("drafter", ["drafter", "--model", model, "--head", args.head,
                                *device(args.drafter_device), "--max-drafts", str(args.k),
                                "--metrics-port", str(metrics_ports["drafter"])], logs)
    common = ["verifier", "--model", model, *device(args.verifier_device), "--max-slots", slots]
    spec = start("verifier", [*common, "--k", str(args.k), "--drafter", f"127.0.0.1:{drafter.port}",
                              "--metrics-port", str(metrics_ports["verifier"])], logs)
    base = start("target-only verifier", [*common, "--k", "0"], logs)
    services = [drafter, spec, base]
    results = []
    try:
        wait_serving(services, 600)
        if not wait_drafter_connected(spec.port, 120):
            raise SystemExit(f"the verifier never connected to the drafter (logs: {logs})")
        for port in (spec.port, base.port):  # warm-up: Triton compiles per shape class, first allocations
            for batch in batch_sizes:
                run_batch(port, PROMPTS[:batch], 16)
        for batch in batch_sizes:
            before = {name: scrape(port) for name, port in metrics_ports.items()}
            s = measure(spec.port, PROMPTS, batch, args.max_tokens, args.repeats)
            after = {name: scrape(port) for name, port in metrics_ports.items()}
            s["per_verification"] = breakdown(before, after, s["seconds"])
            b = measure(base.port, PROMPTS, batch, args.max_tokens, args.repeats)
            same = sum(x == y for x, y in zip(s.pop("outputs"), b.pop("outputs"), strict=True))
            results.append({"batch": batch, "speculative": s, "target_only": b,
                            "speedup": s["tokens_per_s"] / b["tokens_per_s"],
                            "greedy_equal_rate": same / (batch * args.repeats)})
    finally:
        stop(services)

    print(f"{'batch':>5} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8} {'accept len':>11} "
          f"{'greedy ==':>10}")
    for r in results:
        spec_, base_ = r["speculative"], r["target_only"]
        print(f"{r['batch']:>5} {spec_['tokens_per_s']:>11.1f} {base_['tokens_per_s']:>13.1f} "
              f"{r['speedup']:>7.2f}x {spec_['mean_acceptance_length']:>11.2f} "
              f"{r['greedy_equal_rate']:>10.0%}")
        print("      speculative, per verification (ms): " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["speculative"]["per_verification"].items()))
    report = {
        "bench": "services", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "platform": platform.platform(), "model": model, "head": args.head,
        "k": args.k, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "drafter_device": args.drafter_device, "verifier_device": args.verifier_device, "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
