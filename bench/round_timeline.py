"""A round's timeline across both services, from the marks of specwire/round_trace.py (run the services, or
bench_services.py, with SPECWIRE_TRACE_DIR set).

A round runs from one verification's start on the verifier ("v.verify", whose value is the batch size) to the
next one's. Every mark of every process in that window is placed at its offset from the round's start; per
batch size, the table lists each event at the median offset of its first mark in a round, the median gap
from the event listed before it, and the share of rounds that have it.

Before the tables, each verifier's time by batch size, its spans from one prefill step to the next, and its
waits before a verification (from a round's start, "v.round", to its launch: drafts awaited, prefill steps).

    python bench/round_timeline.py TRACE_DIR [--skip 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
from pathlib import Path


def read_marks(trace_dir: Path) -> dict[str, list[tuple[int, str, int]]]:
    """Per file stem (<name>-<pid>): its marks, (ns, event, value), in time order."""
    marks = {}
    for path in sorted(trace_dir.glob("*.txt")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        marks[path.stem] = sorted((int(ns), event, int(value)) for ns, event, value in rows)
    return marks


def rounds(verifier: list[tuple[int, str, int]], others: list[list[tuple[int, str, int]]], skip: int
           ) -> dict[int, list[dict[str, float]]]:
    """Per batch size, per round after the first `skip` of the verifier's run: {event: ms from the round's
    start to its first mark in the round}, and "round" (ms to the next round's start)."""
    starts = [(ns, value) for ns, event, value in verifier if event == "v.verify"]
    merged = sorted([*verifier, *(m for marks in others for m in marks)])
    times = [ns for ns, _, _ in merged]
    out: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for (start, batch), (end, _) in list(zip(starts[:-1], starts[1:], strict=True))[skip:]:
        first: dict[str, float] = {}
        for ns, event, _ in merged[bisect.bisect_left(times, start):bisect.bisect_left(times, end)]:
            first.setdefault(event, (ns - start) / 1e6)
        first["round"] = (end - start) / 1e6
        out[batch].append(first)
    return out


def table(batch_rounds: list[dict[str, float]]) -> list[dict[str, float]]:
    events = {event for r in batch_rounds for event in r}
    rows = []
    for event in events:
        offsets = [r[event] for r in batch_rounds if event in r]
        rows.append({"event": event, "median_ms": statistics.median(offsets),
                     "share": len(offsets) / len(batch_rounds)})
    rows.sort(key=lambda row: row["median_ms"])
    for before, row in zip([None, *rows[:-1]], rows, strict=True):
        row["gap_ms"] = row["median_ms"] - (before["median_ms"] if before else 0.0)
    return rows


def time_by_batch(verifier: list[tuple[int, str, int]]) -> list[dict[str, float]]:
    """Per batch size, the verifier's whole run: its rounds, their time and share of the run, the median
    round. A static batch's rows end at different rounds, so its tail runs at smaller batch sizes."""
    spans = {batch: [r["round"] for r in rs] for batch, rs in rounds(verifier, [], skip=0).items()}
    run = sum(sum(ms) for ms in spans.values())  # from the first round's start to the last one's
    return [{"batch": batch, "rounds": len(ms), "ms": sum(ms), "share": sum(ms) / run if run else 0.0,
             "median_ms": statistics.median(ms)} for batch, ms in sorted(spans.items(), reverse=True)]


def prefill_spans(verifier: list[tuple[int, str, int]]) -> list[dict[str, float]]:
    """From each prefill step to the next: its length, the prefill's, the wait for the first verification
    after it, how many rounds ran, and the time from the last verification's end to the next prefill (the
    client's turn, at batch 1: the stream's end, its next request, the admission)."""
    out = []
    prefills = [i for i, (_, event, _) in enumerate(verifier) if event == "v.prefill"]
    for a, b in zip(prefills[:-1], prefills[1:], strict=True):
        span = verifier[a:b]
        begun, next_prefill = span[0][0], verifier[b][0]
        prefilled = next((ns for ns, event, _ in span if event == "v.prefilled"), None)
        verifies = [ns for ns, event, _ in span if event == "v.verify"]
        ends = [ns for ns, event, _ in span if event == "v.verify_end"]
        if prefilled is None or not verifies or not ends:
            continue
        out.append({"ms": (next_prefill - begun) / 1e6, "prefill_ms": (prefilled - begun) / 1e6,
                    "to_first_verify_ms": (verifies[0] - prefilled) / 1e6, "rounds": len(verifies),
                    "after_last_ms": (next_prefill - ends[-1]) / 1e6})
    return out


def waits_before_verify(verifier: list[tuple[int, str, int]], over_ms: float) -> dict[str, float]:
    """From each round's start ("v.round") to the launch of its verification ("v.verify"): how many, how
    many took over `over_ms` and their sum, against the run from the first verification to the last (a
    round that waits for a drafter's answer, or runs a prefill step first, shows here)."""
    waits, began = [], None
    for ns, event, _ in verifier:
        if event == "v.round":
            began = ns
        elif event == "v.verify" and began is not None:
            waits.append((ns - began) / 1e6)
            began = None
    verifies = [ns for ns, event, _ in verifier if event == "v.verify"]
    long = [ms for ms in waits if ms > over_ms]
    return {"rounds": len(waits), "over": len(long), "over_ms": sum(long), "all_ms": sum(waits),
            "run_ms": (verifies[-1] - verifies[0]) / 1e6 if verifies else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--skip", type=int, default=50, help="rounds of each verifier run left out (warm-up)")
    p.add_argument("--json", type=Path, help="also write the tables here")
    p.add_argument("--wait-ms", type=float, default=0.8, help="a wait before a verification counted as long")
    args = p.parse_args()
    marks = read_marks(args.trace_dir)
    report = {}
    for name, verifier in marks.items():
        if not any(event == "v.verify" for _, event, _ in verifier):
            continue
        by_batch, spans = time_by_batch(verifier), prefill_spans(verifier)
        waits = waits_before_verify(verifier, args.wait_ms)
        report[f"{name}/time_by_batch"], report[f"{name}/prefill_spans"] = by_batch, spans
        report[f"{name}/waits_before_verify"] = waits
        print(f"== {name}: time by batch size (whole run)")
        for row in by_batch:
            print(f"  batch {row['batch']:3d}: {row['rounds']:5d} rounds, {row['ms']:9.1f} ms"
                  f" ({row['share']:6.1%}), median {row['median_ms']:.3f} ms")
        if spans:
            medians = {key: statistics.median(s[key] for s in spans) for key in spans[0]}
            print(f"== {name}: prefill to prefill, medians of {len(spans)}: " +
                  ", ".join(f"{key} {value:.2f}" for key, value in medians.items()))
        print(f"== {name}: before a verification, {waits['rounds']} waits of {waits['all_ms']:.1f} ms,"
              f" {waits['over']} over {args.wait_ms} ms summing {waits['over_ms']:.1f} ms, in a run of"
              f" {waits['run_ms']:.1f} ms")
        window = (verifier[0][0], verifier[-1][0])  # other processes' marks while this verifier ran
        others = [[m for m in other if window[0] <= m[0] <= window[1]]
                  for other_name, other in marks.items() if other_name != name]
        for batch, batch_rounds in sorted(rounds(verifier, others, args.skip).items()):
            rows = table(batch_rounds)
            report[f"{name}/batch{batch}"] = {"rounds": len(batch_rounds), "events": rows}
            print(f"== {name}, batch {batch}: {len(batch_rounds)} rounds")
            print(f"{'event':>20} {'at ms':>8} {'gap ms':>8} {'share':>6}")
            for row in rows:
                print(f"{row['event']:>20} {row['median_ms']:8.3f} {row['gap_ms']:8.3f} {row['share']:6.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
