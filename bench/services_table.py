"""A bench_services.py result file as the Markdown table the READMEs show.

    python bench/services_table.py bench/results/services_h200x2.json [--temperature T] [--setups A,B]

One row per point: setup, k, forced length, batch, load (a static batch or sustained concurrency), tokens/s,
speedup over target-only and its ideal (tau * t_target / t_verify, from the engine thread's verification
time and from its device time), mean acceptance length (rounds with drafts), tokens per verification (all
rounds), TTFT p50, inter-chunk latency p50 / p99, a verification step's split (verify / draft / transport /
host, ms), the verifier's device time a verification and its idle time before one (waiting for the launch,
for drafts; CUDA, files since session 39), the prefill steps (how many, ms each), GPU busy shares and
drafter-link bytes per step. Below it,
for the points with a speculation cache, its rounds by drafting mode (tables, serial, none): how many, their
mean time and the tokens each settled (files written since session 31).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specwire.metrics import DRAFTING_MODES


def fmt(value: object, spec: str, suffix: str = "") -> str:
    return format(value, spec) + suffix if isinstance(value, int | float) else "—"


def row(r: dict) -> list[str]:
    split = r.get("round_ms") or {}
    busy = r.get("gpu_busy") or {}
    wire = r.get("wire_bytes_per_step") or {}
    itl = r.get("itl_ms") or {}
    prefill = r.get("prefill") or {}
    return [
        r["setup"], fmt(r.get("k"), "d"), fmt(r.get("forced_acceptance_length"), "g"),
        str(r["forced_hit_rate"]) if r.get("forced_hit_rate") is not None else "—", fmt(r["batch"], "d"),
        r.get("load", "batch"),
        fmt(r["tokens_per_s"], ",.0f"), fmt(r.get("speedup"), ".2f", "x"),
        f"{fmt(r.get('ideal_speedup'), '.2f', 'x')} / {fmt(r.get('ideal_speedup_gpu'), '.2f', 'x')}",
        fmt(r.get("mean_acceptance_length"), ".2f"),
        f"{fmt(tokens_per_verification(r), '.2f')} / {fmt(r.get('rows_per_verification'), '.1f')}",
        fmt((r.get("ttft_ms") or {}).get("p50"), ".1f"),
        f"{fmt(itl.get('p50'), '.2f')} / {fmt(itl.get('p99'), '.2f')}",
        " / ".join(fmt(split.get(k), ".2f") for k in ("verify", "draft", "transport", "host")),
        f"{fmt(split.get('verify_gpu'), '.2f')} / {fmt(split.get('gpu_idle_launch'), '.2f')} / "
        f"{fmt(split.get('gpu_idle_drafts'), '.2f')}",
        f"{fmt(prefill.get('steps'), '.0f')} x {fmt(prefill.get('ms'), '.1f')}",
        " / ".join(fmt(v, ".0f", "%") for k, v in sorted(busy.items()) if k.startswith("gpu")) or "—",
        f"{fmt(wire.get('sent'), ',.0f')} / {fmt(wire.get('received'), ',.0f')}",
    ]


def tokens_per_verification(r: dict) -> float | None:
    """Decode tokens a request gains per verification, rounds without drafts included (tau counts only the
    rounds that had drafts: with late speculation-cache tables the two differ widely). Files written before
    bench_services.py recorded it get it from the same fields."""
    if "tokens_per_verification" in r:
        return r["tokens_per_verification"]
    steps = (r.get("round_ms") or {}).get("steps")
    return (r["tokens"] - r["requests"]) / (steps * r["batch"]) if steps else None


HEADER = ["setup", "k", "L", "hit", "batch", "load", "tok/s", "speedup", "ideal: thread / gpu", "tau",
          "tok/verif. / rows",
          "TTFT p50 ms", "ITL p50 / p99 ms", "step: verify / draft / transport / host ms",
          "verifier GPU: verify / idle for launch / idle for drafts ms", "prefill steps x ms", "GPU busy",
          "bytes/step sent / recv"]


def table(report: dict, temperature: float = 0.0, setups: list[str] | None = None) -> str:
    rows = [row(r) for r in report["results"]
            if r["temperature"] == temperature and (not setups or r["setup"] in setups)]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def modes_table(report: dict, temperature: float = 0.0, setups: list[str] | None = None) -> str:
    """The speculation cache's rounds by drafting mode, per point that timed them ("" when none did)."""
    lines = []
    for r in report["results"]:
        cache = r.get("cache") or {}
        timed = cache.get("round_ms") or {}
        wanted = r["temperature"] == temperature and (not setups or r["setup"] in setups)
        if not wanted or not any(timed.values()):
            continue
        per_round = cache.get("tokens_per_round") or {}
        lines.append("| " + " | ".join([
            r["setup"], str(r["forced_hit_rate"]) if r.get("forced_hit_rate") is not None else "—",
            fmt(r["batch"], "d"), r.get("load", "batch"),
            " / ".join(fmt((cache.get("rounds") or {}).get(m), ".0f") for m in DRAFTING_MODES),
            " / ".join(fmt(timed.get(m), ".2f") for m in DRAFTING_MODES),
            " / ".join(fmt(per_round.get(m), ".2f") for m in DRAFTING_MODES)]) + " |")
    if not lines:
        return ""
    header = ["setup", "hit", "batch", "load", "rounds: tables / serial / none", "ms a round",
              "tokens a round"]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *lines])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--setups", default="", help="comma-separated setups to keep (default: all)")
    args = p.parse_args()
    report = json.loads(Path(args.file).read_text())
    print(f"{report['workload']}, T = {args.temperature:g}, {report['date']}, commit {report['commit']}, "
          f"{', '.join(report['machine'].get('gpus') or [report['machine']['platform']])}\n")
    setups = [s for s in args.setups.split(",") if s]
    print(table(report, args.temperature, setups))
    if modes := modes_table(report, args.temperature, setups):
        print(f"\n{modes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
