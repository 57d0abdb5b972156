"""PNG plots of bench_services.py results (matplotlib, a bench dependency: `pip install matplotlib`).

    python bench/plot_services.py bench/results/services_h200x2.json [more.json ...]

writes FILE.png beside each JSON: (a) tokens/s by batch for every setup, (b) speedup over target-only and
the ideal tau * t_target / t_verify by batch, (c) where a verification step's time goes (two GPUs), (d) the
client's inter-chunk latency p50 and p99. Greedy (T = 0) points; the forced length or k in each label.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

SPLIT = ("verify", "draft", "transport", "host")


def label(r: dict) -> str:
    """A series: a setup's configuration and load (sustained rows apart from static batches)."""
    load = " sustained" if r.get("load") == "sustained" else ""
    if r["setup"] in ("target_only", "transformers"):
        return r["setup"] + load
    length, hit = r.get("forced_acceptance_length"), r.get("forced_hit_rate")
    return (f"{r['setup']} k={r['k']}" + (f" L={length:g}" if length else "") + (f" hit={hit}" if hit else "")
            + load)


def series(results: list[dict], temperature: float = 0.0) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in results:
        if r["temperature"] == temperature:
            out[label(r)].append(r)
    return {name: sorted(rows, key=lambda r: r["batch"]) for name, rows in out.items()}


def plot(path: Path) -> Path:
    report = json.loads(path.read_text())
    lines = series(report["results"])
    fig, ((tput, speed), (split, itl)) = plt.subplots(2, 2, figsize=(13, 9))
    for name, rows in lines.items():
        batches = [r["batch"] for r in rows]
        tput.plot(batches, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        if name.startswith(("two_gpus", "colocated")):
            line, = speed.plot(batches, [r.get("speedup") for r in rows], marker="o", label=name)
            speed.plot(batches, [r.get("ideal_speedup") for r in rows], ls="--", color=line.get_color())
        if "itl_ms" in rows[0] and rows[0]["itl_ms"]:
            line, = itl.plot(batches, [r["itl_ms"]["p50"] for r in rows], marker="o", label=f"{name} p50")
            itl.plot(batches, [r["itl_ms"]["p99"] for r in rows], ls=":", color=line.get_color())
    two = next((rows for name, rows in lines.items() if name.startswith("two_gpus")), [])
    bottom = [0.0] * len(two)
    for part in SPLIT:
        values = [max(0.0, (r.get("round_ms") or {}).get(part) or 0.0) for r in two]
        split.bar([str(r["batch"]) for r in two], values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for ax, title, ylabel in ((tput, "tokens/s (T = 0)", "tokens/s"),
                              (speed, "speedup over target-only (dashed: ideal)", "x"),
                              (split, f"a verification step, {label(two[0]) if two else 'two_gpus'}", "ms"),
                              (itl, "inter-chunk latency p50 (dotted: p99)", "ms")):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("batch")
        ax.legend(fontsize=7)
        if ax is not split:
            ax.set_xscale("log", base=2)
    for ax in (tput, itl):
        ax.set_yscale("log")
    speed.axhline(1.0, color="grey", lw=0.8)
    machine = ", ".join(report["machine"].get("gpus") or [report["machine"].get("platform", "")])
    fig.suptitle(f"{report['workload']}: {report['model']}, {report['max_tokens']} tokens, {machine}, "
                 f"{report['date']}, commit {report['commit'][:12]}", fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(paths: list[str]) -> int:
    if not paths:
        raise SystemExit(__doc__)
    for p in paths:
        print(plot(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
