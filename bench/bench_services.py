"""Both services end to end over gRPC, setups side by side in one run: drafter and verifier on two GPUs,
both in one process on one GPU (co-located), target-only on our engine (a verifier with --k 0) and
transformers `generate()`; on SmolLM2 with the shipped head and on a Llama-3.1-8B-shaped synthetic target at
forced mean acceptance lengths and speculation-cache hit rates; at several batch sizes, temperatures and k.

    python bench/bench_services.py --model /root/m/smol.gguf --drafter-device cuda:0 \
        --verifier-device cuda:1 --out-dir bench/results --tag h200x2

writes services_h200x2.json (SmolLM2) and services_8b_synthetic_h200x2.json (the synthetic 8B shape); see
bench/README.md for the device command, bench/plot_services.py for the plots. Every point sends `batch`
requests at once (fixed length: ignore_eos; unseeded, since the verifier asks seeded requests for greedy
drafts and users rarely seed), `--repeats` times and at least `--min-requests` requests in all; with `--loads
sustained`, also `batch` requests in flight at a time (lanes that each send their next request when the last
one ends, as many requests in all as the static point; a static batch lasts until its slowest request ends,
which speculation's varying acceptance makes later than target-only's), and reads:

- from the client's stream (bench/services_client.py): tokens/s (all tokens / wall time of the batches),
  TTFT, inter-chunk latency and TPOT percentiles, mean acceptance length (from the requests' usage);
- from the services' /metrics (bench/services_metrics.py): a verification step's time split (verify, draft,
  transport, host), the prefill steps (how many, ms each, share of the wall time), the speculation cache's
  hit rate when the verifier has one, drafter-link bytes per step;
- each GPU's busy share (bench/gpu_busy.py).

Per speculative point, against the target-only point of the same batch and temperature in the same run:
`speedup` (tokens/s ratio), `output_equal_rate` (real models, greedy: outputs identical token for token), the
ideal speedup `ideal_speedup` = tau * t_target / t_verify, measured as (decode tokens per second of verify-
step time) / (decode tokens per second of target-only step time): tau is the mean acceptance length, and the
two step times are the verifiers' own specwire_verify_step_seconds (engine thread: forward, sampling,
readback; prefill excluded, so decode tokens = tokens - one per request). It is what the round would give if
nothing but verification were on its critical path. On CUDA `ideal_speedup_gpu` takes the verifications'
device time instead (specwire_verify_gpu_seconds, CUDA events around the forward and the sampler): the
engine-thread time of a verification launched before the drafts it is queued behind are drafted (co-located,
drafts fed from the device) holds the device's wait for them, which the device time leaves out; a
verification launched ahead (--launch-ahead) counts the thread's time launching its forward, then from its
sampler's launch to its tokens, while the device ran part of the forward in between: that thread time can
be shorter than the device time, and its ideal then above `ideal_speedup_gpu`.

With --paired, a second verifier, target-only, runs beside the speculative ones for the whole run, and each
speculative point's batches alternate with its batches of the same prompts (target-only first, then last,
then first...; under sustained load, target-only runs half the point's prompts before it and half after):
`speedup` and `output_equal_rate` are then against those (`paired_target`), measured seconds apart instead
of minutes, so drift of the machine between configurations (target-only's own tokens/s moved by 10% and more
between the sides of one A/B call, bench/results/session39/; an A/A of one code read 1.54x and 0.93x at batch
16, bench/results/session40/) cancels; `speedup_unpaired` keeps the ratio to the target-only row. Its
requests are left out of the GPUs' busy share.

Setups run in priority order until --budget-seconds have passed; the rest are listed as skipped. Results are
written after every configuration, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpu_busy import GpuBusy  # bench/ modules: scripts run as `python bench/<name>.py`
from services_client import Client, RequestTiming, read_prompts, summarize
from services_metrics import (
    Delta,
    cache_hit_rate,
    prefill_split,
    round_split,
    rows_per_verification,
    scrape,
    wire_bytes_per_step,
)
from services_setups import (
    CACHE_BRANCHES,
    COLOCATED,
    SETUPS,
    TWO_PROCESSES,
    Devices,
    Fleet,
    HitRate,
    SetupUnavailable,
    Workload,
    run_transformers,
)
from services_table import tokens_per_verification
from specwire.drafter.cli import DEFAULT_HEAD

from specwire.default_model import resolve_model_path

LOADS = ("batch", "sustained")
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "heldout_chat_sharegpt.jsonl"


def hit_rate(text: str) -> HitRate:
    """'off', a forced rate R, 'ahead' (tables ahead: queued serial drafting, tables looked up on the
    drafter's GPU) or 'ahead:R' (their hits forced at rate R)."""
    text = text.strip()
    if text == "off" or text == "ahead":
        return text
    if text.startswith("ahead:"):
        return f"ahead:{float(text.removeprefix('ahead:'))}"
    return float(text)


def cache_setting(text: str) -> HitRate:
    """A real head's speculation cache: 'on' (--cache-branches 8), 'off' (--cache-branches 0), 'ahead'
    (tables ahead: --queued-tables 8, its hits the head's own) or 'adaptive' (--drafting-epoch: tables,
    serial drafting or no drafts, whichever measures fastest)."""
    if text.strip() not in ("on", "off", "ahead", "adaptive"):
        raise argparse.ArgumentTypeError(f"a cache setting is on, off, ahead or adaptive, got {text!r}")
    return None if text.strip() == "on" else text.strip()


def load_kind(text: str) -> str:
    if text.strip() not in LOADS:
        raise argparse.ArgumentTypeError(f"a load is one of {', '.join(LOADS)}, got {text!r}")
    return text.strip()


def csv(kind: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type: comma-separated values, each converted by `kind` (empty text: an empty list)."""
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=csv(str), default=["smollm2", "synthetic"],
                   help="smollm2 (--model + --head) and/or synthetic (--synthetic-shape at --lengths)")
    p.add_argument("--model", default=None, help="the smollm2 workload's model (default: SmolLM2 GGUF)")
    p.add_argument("--head", default=str(DEFAULT_HEAD), help="its EAGLE head (default: the shipped one)")
    p.add_argument("--synthetic-shape", default="llama-3.1-8b", help="the synthetic workload's shape")
    p.add_argument("--lengths", type=csv(float), default=[3.0, 2.0, 4.0],
                   help="forced mean acceptance lengths of the synthetic workload, first = first measured")
    p.add_argument("--verifier-args", default="",
                   help="more flags for the smollm2 workload's speculative verifiers ('--cache-branches 0')")
    p.add_argument("--synthetic-verifier-args", default="",
                   help="more flags for the synthetic workload's speculative verifiers")
    p.add_argument("--hit-rates", type=csv(hit_rate), default=[0.8, "off"],
                   help="the synthetic workload's speculation cache, first = first measured: R = "
                        "--forced-hit-rate R (a random head never guesses the bonus token itself), 'off' = "
                        "--cache-branches 0, serial drafting, 'ahead:R' = tables ahead (--queued-tables, "
                        "looked up on the drafter's GPU) at forced hit rate R, 'ahead' = "
                        "unforced (default 0.8,off)")
    p.add_argument("--smollm2-cache", type=csv(cache_setting), default=[None, "off"],
                   help="the smollm2 workload's speculation cache, first = first measured: on = "
                        "--cache-branches 8, off = --cache-branches 0, serial drafting, ahead = tables "
                        "ahead (--queued-tables, unforced), adaptive = "
                        "--drafting-epoch 16, whichever of tables, serial and no drafts measures fastest "
                        "(default on,off)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt file")
    p.add_argument("--prompt-source", default="",
                   help="keep rows whose 'source' starts with this ('' = all; rows without one are kept)")
    p.add_argument("--max-prompt-bytes", type=int, default=800,
                   help="leave out longer prompts (the synthetic tokenizer makes a token of every byte)")
    p.add_argument("--setups", type=csv(str), default=list(SETUPS), help=f"any of {', '.join(SETUPS)}")
    p.add_argument("--ks", type=csv(int), default=[4], help="k of every speculative setup")
    p.add_argument("--batch-sizes", type=csv(int), default=[1, 8, 16, 32, 64])
    p.add_argument("--temperatures", type=csv(float), default=[0.0, 1.0])
    p.add_argument("--sweep-ks", type=csv(int), default=[2, 3, 5, 6],
                   help="extra k values of --sweep-setup, at --sweep-batch-sizes, after everything else")
    p.add_argument("--sweep-setup", default="two_gpus",
                   help="the speculative setup the k sweep runs (one of --setups; default two_gpus)")
    p.add_argument("--sweep-batch-sizes", type=csv(int), default=[1, 16])
    p.add_argument("--colocated-lengths", type=csv(float), default=[3.0],
                   help="forced lengths the co-located setup runs (synthetic workload)")
    p.add_argument("--hf-batch-sizes", type=csv(int), default=[1, 16, 64])
    p.add_argument("--hf-temperatures", type=csv(float), default=[0.0])
    p.add_argument("--hf-max-tokens", type=int, default=32, help="tokens per transformers request")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="batches per point (requests per lane, sustained)")
    p.add_argument("--min-requests", type=int, default=16,
                   help="more batches where --repeats would send fewer requests than this (small batches: "
                        "3 requests of batch 1 measured co-located SmolLM2 at 0.87x, 16 at 1.45x, one lease)")
    p.add_argument("--loads", type=csv(load_kind), default=["batch"],
                   help="batch (all of a batch sent at once, --repeats times) and/or sustained (batch "
                        "requests in flight at a time; batch sizes > 1)")
    p.add_argument("--branches", type=int, default=CACHE_BRANCHES,
                   help="table entries per request of the speculation cache and of tables ahead (the "
                        "verifiers' --cache-branches / --queued-tables, the drafter's --max-branches)")
    p.add_argument("--paired", action="store_true",
                   help="each speculative point's batches alternate with target-only batches of the same "
                        "prompts on a target-only verifier kept beside it (target first, then the other "
                        "first, ...; sustained: half the prompts before the point, half after): `speedup` is "
                        "over those, measured minutes closer than the target-only row; `speedup_unpaired` "
                        "keeps the ratio to that row")
    p.add_argument("--chunk-times", action="store_true",
                   help="write every request's chunk arrival times and sizes to chunks_TAG.jsonl (where ITL "
                        "goes)")
    p.add_argument("--max-context", type=int, default=1024, help="services' KV positions per request")
    p.add_argument("--drafter-device", default=None)
    p.add_argument("--verifier-device", default=None)
    p.add_argument("--client-processes", type=int, default=min(8, (os.cpu_count() or 1) // 4),
                   help="client processes a batch is spread over (default: a quarter of the CPUs, <= 8)")
    p.add_argument("--budget-seconds", type=float, default=480,
                   help="start no configuration expected to end after this many seconds (default 480)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tag", default="local", help="result files are services[_SHAPE_synthetic]_TAG.json")
    p.add_argument("--commit", default=os.environ.get("SPECWIRE_COMMIT"),
                   help="the commit measured, when the tree is not a git checkout (env SPECWIRE_COMMIT)")
    args = p.parse_args(argv)
    if bad := [s for s in args.setups if s not in SETUPS]:
        p.error(f"unknown setup {bad[0]!r}")
    if args.sweep_setup not in (*TWO_PROCESSES, *COLOCATED):
        p.error(f"--sweep-setup must be a speculative setup ({', '.join((*TWO_PROCESSES, *COLOCATED))})")
    return args


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.workloads:
        if name == "smollm2":
            out.append(Workload("smollm2", str(resolve_model_path(args.model)), args.head, (None,),
                                tuple(shlex.split(args.verifier_args)), tuple(args.smollm2_cache)))
        elif name == "synthetic":
            shape = args.synthetic_shape
            out.append(Workload(f"synthetic-{shape}", f"synthetic:{shape}", None, tuple(args.lengths),
                                tuple(shlex.split(args.synthetic_verifier_args)), tuple(args.hit_rates)))
        else:
            raise SystemExit(f"unknown workload {name!r} (smollm2, synthetic)")
    return out


def out_file(args: argparse.Namespace, w: Workload) -> Path:
    if not w.synthetic:
        return Path(args.out_dir) / f"services_{args.tag}.json"
    shape = args.synthetic_shape.replace("llama-3.1-", "")
    return Path(args.out_dir) / f"services_{shape}_synthetic_{args.tag}.json"


# workload, setup, k, forced length, speculation cache (HitRate), batch sizes
Job = tuple[Workload, str, int, float | None, HitRate, list[int]]


def jobs(args: argparse.Namespace, ws: list[Workload]) -> list[Job]:
    """The configurations in the order they run: target-only first (every speedup needs it), then two GPUs
    (over gRPC, then over the step socket) at the first length and cache setting, the other lengths, the
    other cache settings, co-located (each cache setting), transformers, the k sweep (--sweep-setup)."""
    out = []
    twos, cos = [s for s in TWO_PROCESSES if s in args.setups], [s for s in COLOCATED if s in args.setups]
    sweep = args.sweep_setup if args.sweep_setup in args.setups else None
    for phase in range(7):
        for w in ws:
            length, hit = w.lengths[0], w.hit_rates[0]
            if phase == 0 and "target_only" in args.setups:
                out.append((w, "target_only", 0, None, None, args.batch_sizes))
            if phase == 1:
                out += [(w, s, k, length, hit, args.batch_sizes) for s in twos for k in args.ks]
            if phase == 2:
                out += [(w, s, k, x, hit, args.batch_sizes)
                        for s in twos for x in w.lengths[1:] for k in args.ks]
            if phase == 3:
                out += [(w, s, k, length, h, args.batch_sizes)
                        for s in twos for h in w.hit_rates[1:] for k in args.ks]
            if phase == 4 and cos:  # every cache setting: without gRPC, serial drafting pays the hop least
                lengths = [x for x in w.lengths if x in args.colocated_lengths] or [length]
                out += [(w, s, k, x, h, args.batch_sizes)
                        for s in cos for h in w.hit_rates for k in args.ks for x in lengths]
            if phase == 5 and "transformers" in args.setups:
                out.append((w, "transformers", 0, None, None, args.hf_batch_sizes))
            if phase == 6 and sweep:
                out += [(w, sweep, k, length, hit, args.sweep_batch_sizes) for k in args.sweep_ks
                        if k not in args.ks]
    return out


def batches_per_point(batch: int, repeats: int, min_requests: int) -> int:
    """`repeats` batches, or more where that is fewer than `min_requests` requests."""
    return max(repeats, -(-min_requests // batch))


def measure(client: Client, port: int, metric_ports: dict[str, int | None], gpus: list[int],
            prompts: list[str], batches: list[int], args: argparse.Namespace, paired: int | None = None
            ) -> list[dict]:
    """Rows of one running configuration: every (batch, temperature, load), after a short warm-up of each
    batch and temperature. Both loads send the same prompts in the same order. paired: the port of a
    target-only verifier whose requests alternate with this one's (--paired)."""
    for batch in batches:
        for temperature in args.temperatures:
            client.run_batch(port, prompts[:batch], 16, temperature)
            if paired is not None:
                client.run_batch(paired, prompts[:batch], 16, temperature)
    rows = []
    for batch in batches:
        for temperature in args.temperatures:
            for load in args.loads:
                if load == "sustained" and batch == 1:  # one request at a time either way
                    continue
                repeats = batches_per_point(batch, args.repeats, args.min_requests)
                chosen = [prompts[i % len(prompts)] for i in range(repeats * batch)]
                before = {name: scrape(p) for name, p in metric_ports.items()}
                wall, timings, target = 0.0, [], [0.0, []]  # target: a --paired point's (wall, timings)
                send = functools.partial(_send, client, load=load, batch=batch, max_tokens=args.max_tokens,
                                         temperature=temperature)
                with GpuBusy(gpus) as busy:
                    run_target = functools.partial(_paired_target, send, paired, busy=busy, into=target)
                    if load == "sustained":
                        half = (repeats // 2) * batch or len(chosen)  # target-only before and after it
                        if paired is not None:
                            run_target(chosen[:half])
                        wall, timings = send(port, chosen)
                        if paired is not None and chosen[half:]:
                            run_target(chosen[half:])
                    else:
                        for r in range(repeats):
                            sent = chosen[r * batch:(r + 1) * batch]
                            if paired is not None and r % 2 == 0:  # target-only first in even repeats
                                run_target(sent)
                            seconds, got = send(port, sent)
                            wall, timings = wall + seconds, timings + got
                            if paired is not None and r % 2 == 1:  # and last in odd ones
                                run_target(sent)
                delta = Delta(before, {name: scrape(p) for name, p in metric_ports.items()})
                start = min(t.sent_at for t in timings)
                paired_row = {} if not target[1] else {
                    "paired_target": {k: v for k, v in summarize(*target).items()
                                      if k in ("requests", "tokens", "seconds", "tokens_per_s")},
                    "_paired_outputs": [t.token_ids for t in target[1]]}
                rows.append({"batch": batch, "temperature": temperature, "load": load,
                             **summarize(wall, timings), **paired_row,
                             "round_ms": round_split(delta, wall), "prefill": prefill_split(delta, wall),
                             "cache": cache_hit_rate(delta),
                             "wire_bytes_per_step": wire_bytes_per_step(delta), "gpu_busy": busy.result(),
                             "_outputs": [t.token_ids for t in timings],
                             "stream_outputs_joined": delta.get(
                                 "verifier", "specwire_stream_outputs_joined_total"),
                             # requests a round whose next drafts were queued behind its sampler
                             "queued_drafts": delta.get("verifier", "specwire_queued_drafts_total"),
                             # verifications that read a drafter process's queued drafts on the GPU
                             "drafts_read_on_device": delta.get(
                                 "verifier", "specwire_queued_drafts_read_on_device_total"),
                             # of them, verifications launched before the last one's tokens were back
                             "launched_ahead": delta.get(
                                 "verifier", "specwire_verifications_launched_ahead_total"),
                             # rows that sat a round out for their first drafts (_beside_device_drafts)
                             "rows_sat_out": delta.get("verifier", "specwire_queued_drafts_sat_out_total"),
                             # the batch a verification ran at: below `batch` in a static batch's tail
                             "rows_per_verification": rows_per_verification(delta),
                             "_chunks": [{"sent": t.sent_at - start, "arrivals": t.arrivals,
                                          "tokens": t.chunk_tokens} for t in timings],
                             "_step_seconds": delta.get("verifier", "specwire_verify_step_seconds_sum"),
                             "_gpu_seconds": delta.get("verifier", "specwire_verify_gpu_seconds_sum")})
    return rows


def _send(client: Client, port: int, prompts: list[str], load: str, batch: int, max_tokens: int,
          temperature: float) -> tuple[float, list[RequestTiming]]:
    """(wall seconds, timings) of `prompts` sent to a verifier under `load`: all at once (batch), or in
    `batch` lanes (sustained)."""
    if load == "sustained":
        return client.run_sustained(port, prompts, batch, max_tokens, temperature)
    return client.run_batch(port, prompts, max_tokens, temperature)


def _paired_target(send: Callable[[int, list[str]], tuple[float, list[RequestTiming]]], port: int,
                   prompts: list[str], busy: GpuBusy, into: list) -> None:
    """Target-only requests of a --paired point, sent as the point's are (`send`), added to `into` ([wall,
    timings]); the GPUs' busy share is not sampled meanwhile."""
    with busy.paused():
        seconds, got = send(port, prompts)
    into[0] += seconds
    into[1] += got


def _mismatch(request: int, got: list[int], want: list[int]) -> dict:
    """Where a request's output first parts from target-only's, and the 4 tokens from there on each side."""
    shorter = min(len(got), len(want))
    at = next((j for j in range(shorter) if got[j] != want[j]), shorter)
    return {"request": request, "position": at, "got": got[at:at + 4], "target_only": want[at:at + 4]}


def compare(row: dict, base: dict | None, real_model: bool) -> dict:
    """speedup, output equality and the ideal speedup of a row against the target-only row (same point)."""
    if row["setup"] == "target_only":
        return {"speedup": 1.0}
    paired = row.get("paired_target")
    if base is None and paired is None:
        return {"speedup": None}
    # --paired: against the target-only batches run between this point's, the same prompts
    reference = paired or base
    out = {"speedup": row["tokens_per_s"] / reference["tokens_per_s"]}
    if paired is not None:
        out["speedup_unpaired"] = row["tokens_per_s"] / base["tokens_per_s"] if base is not None else None
    if row["setup"] == "transformers" or base is None:
        return out
    # The same over the decode time alone: prefill steps are the same work in both runs, a larger share of
    # the shorter one's wall (a diagnostic beside `speedup`, which is what users get).
    shares = [(r.get("prefill") or {}).get("share") for r in (row, base)]
    if None not in shares and shares[0] < 1:
        out["speedup_decode"] = out["speedup"] * (1 - shares[1]) / (1 - shares[0])
    if real_model and row["temperature"] == 0:
        reference_outputs = row["_paired_outputs"] if paired else base["_outputs"]
        pairs = list(zip(row["_outputs"], reference_outputs, strict=True))
        out["output_equal_rate"] = sum(a == b for a, b in pairs) / len(pairs)
        # Where an output parts from target-only's (up to 8): a lone late divergence suggests bf16 batch
        # variance at a near tie (the two runs batch the request differently); a bug would show early, often.
        out["output_mismatches"] = [_mismatch(i, a, b) for i, (a, b) in enumerate(pairs) if a != b][:8]
    steps, base_steps = row["round_ms"]["steps"], base["round_ms"]["steps"]
    if (per_verification := tokens_per_verification(row)) is not None:
        out["tokens_per_verification"] = per_verification
    decode, base_decode = row["tokens"] - row["requests"], base["tokens"] - base["requests"]
    for seconds, suffix in (("_step_seconds", ""), ("_gpu_seconds", "_gpu")):
        if row.get(seconds) and base.get(seconds) and steps and base_steps:
            ideal = (decode / row[seconds]) / (base_decode / base[seconds])
            out |= {f"ideal_speedup{suffix}": ideal, f"speedup_over_ideal{suffix}": out["speedup"] / ideal,
                    f"t_verify{suffix}_ms": 1e3 * row[seconds] / steps,
                    f"t_target{suffix}_ms": 1e3 * base[seconds] / base_steps}
    return out


def run_job(fleet: Fleet, client: Client, job: Job, prompts: list[str], args: argparse.Namespace
            ) -> list[dict]:
    w, setup, k, length, hit, batches = job
    devices = fleet.devices
    if setup == "transformers":
        got = run_transformers(w, devices.verifier, prompts, batches, args.hf_temperatures,
                               args.hf_max_tokens, fleet.logs, timeout=max(60.0, args.budget_seconds))
        return [{**r, "cache_implementation": r.pop("cache")} for r in got["results"]]
    service = fleet.verifier(w, setup, k, length, hit)
    try:
        drafter = fleet.drafters.get(w.name) if setup in TWO_PROCESSES else None
        ports = {"verifier": fleet.metrics_port(service), "drafter": fleet.metrics_port(drafter)}
        paired = fleet.paired_target(w).port if args.paired and setup != "target_only" else None
        return measure(client, service.port, ports, devices.gpu_indices(setup), prompts, batches, args,
                       paired)
    finally:
        fleet.stop(service)


class Pace:
    """How long configurations took, per batch size measured, to expect the next one's time: the same
    workload and setup if it ran before, else the slowest setup of the workload so far, else nothing."""

    def __init__(self):
        self.rate: dict[tuple[str, str], float] = {}

    def record(self, workload: str, setup: str, batches: int, seconds: float) -> None:
        self.rate[workload, setup] = seconds / max(1, batches)

    def expect(self, workload: str, setup: str, batches: int) -> float:
        same = self.rate.get((workload, setup))
        known = [r for (w, _), r in self.rate.items() if w == workload]
        return batches * (same if same is not None else max(known, default=0.0))


def machine() -> dict:
    gpus = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True
                              ).stdout.splitlines()
    import torch

    return {"hostname": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "torch": torch.__version__, "cpus": os.cpu_count(), "gpus": gpus}


def commit(given: str | None) -> str:
    if given:
        return given
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", *argv], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).parent).stdout.strip()

        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        return head + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report(w: Workload, rows: list[dict], skipped: list[dict], header: dict) -> dict:
    def point(r: dict) -> tuple:
        return r["batch"], r["temperature"], r.get("load", "batch")  # transformers rows: static batches

    base = {point(r): r for r in rows if r["setup"] == "target_only"}
    results = []
    for r in rows:
        extra = compare(r, base.get(point(r)), not w.synthetic)
        results.append({k: v for k, v in (r | extra).items() if not k.startswith("_")})
    head = w.head or ("random EAGLE-1 (synthetic)" if w.synthetic else "default")
    lengths = list(w.lengths) if w.synthetic else None
    hits = list(w.hit_rates)
    return {**header, "workload": w.name, "model": w.model, "head": head,
            "verifier_args": list(w.verifier_args),
            "forced_acceptance_lengths": lengths, "forced_hit_rates": hits, "results": results,
            "skipped": skipped}


def write_chunk_times(path: Path, workload: str, rows: list[dict]) -> None:
    """Appends a line per point: its configuration and each request's send time (seconds after the point's
    first) and chunk arrival times (seconds after its send). Rows without them (transformers `generate()`,
    which streams nothing) are left out."""
    keys = ("setup", "k", "forced_acceptance_length", "forced_hit_rate", "batch", "temperature", "load")
    with path.open("a") as f:
        for r in (r for r in rows if "_chunks" in r):
            line = {"workload": workload, **{k: r.get(k) for k in keys}, "requests": r["_chunks"]}
            f.write(json.dumps(line) + "\n")


def print_table(name: str, results: list[dict]) -> None:
    print(f"\n{name}")
    columns = [("setup", "setup", ">12"), ("k", "k", ">2"), ("L", "forced_acceptance_length", ">4.1f"),
               ("hit", "forced_hit_rate", ">4"),
               ("T", "temperature", ">3.0f"), ("batch", "batch", ">5"), ("load", "load", ">9"),
               ("tok/s", "tokens_per_s", ">9.1f"),
               ("speedup", "speedup", ">7.2f"), ("ideal", "ideal_speedup", ">6.2f"),
               ("tau", "mean_acceptance_length", ">5.2f"), ("TTFT p50", "ttft_ms", ">9.1f"),
               ("ITL p50", "itl_ms", ">8.2f")]

    def cell(r: dict, key: str, spec: str) -> str:
        v = r.get(key)
        v = v.get("p50") if isinstance(v, dict) else v
        width = spec.lstrip(">").split(".")[0]
        return format(v, spec) if isinstance(v, int | float | str) else format("-", f">{width}")

    print(" ".join(format(title, f">{spec.lstrip('>').split('.')[0]}") for title, _, spec in columns))
    for r in results:
        print(" ".join(cell(r, key, spec) for _, key, spec in columns))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # cuda:N is NVML's GPU N (gpu_busy.py)
    started = time.monotonic()
    ws = workloads(args)
    prompts = read_prompts(args.prompts, args.prompt_source, args.max_prompt_bytes)
    header = {
        "bench": "services", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "commit": commit(args.commit), "machine": machine(),
        "prompts": {"file": args.prompts, "source_prefix": args.prompt_source,
                    "max_bytes": args.max_prompt_bytes, "count": len(prompts)},
        "max_tokens": args.max_tokens, "repeats": args.repeats, "min_requests": args.min_requests,
        "loads": args.loads, "max_context": args.max_context, "branches": args.branches,
        "client_processes": args.client_processes,
        "devices": {"drafter": args.drafter_device, "verifier": args.verifier_device},
        # the services read their defaults from these; a run under SPECWIRE_SWITCH_INTERVAL=... says so
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECWIRE_")},
    }
    plan = jobs(args, ws)
    max_batch = max([*args.batch_sizes, *args.sweep_batch_sizes])
    fleet = Fleet(Devices(args.drafter_device, args.verifier_device), max_batch,
                  max([*args.ks, *args.sweep_ks]), args.max_context, branches=args.branches)
    rows: dict[str, list[dict]] = {w.name: [] for w in ws}
    skipped: dict[str, list[dict]] = {w.name: [] for w in ws}
    unavailable: dict[str, str] = {}  # setup -> why the services refused it
    print(f"{len(plan)} configurations; service logs in {fleet.logs}", flush=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    client, pace = Client(args.client_processes), Pace()
    try:
        for job in plan:
            w, setup, k, length, hit, batches = job
            where = {"setup": setup, "k": k, "forced_acceptance_length": length, "forced_hit_rate": hit}
            reason = unavailable.get(setup)
            elapsed, expected = time.monotonic() - started, pace.expect(w.name, setup, len(batches))
            if reason is None and elapsed + expected > args.budget_seconds:
                reason = f"budget: {args.budget_seconds:.0f} s, at {elapsed:.0f} s, expected {expected:.0f} s"
            if reason is None:
                print(f"[{elapsed:6.1f} s] {w.name}: {setup} k={k} L={length} hit={hit}", flush=True)
                try:
                    got = [{**where, **r} for r in run_job(fleet, client, job, prompts, args)]
                    if args.chunk_times:
                        write_chunk_times(Path(args.out_dir) / f"chunks_{args.tag}.jsonl", w.name, got)
                    rows[w.name] += got
                    pace.record(w.name, setup, len(batches), time.monotonic() - started - elapsed)
                except SetupUnavailable as e:
                    unavailable[setup] = reason = str(e)
                except Exception as e:  # recorded with the run; the other configurations go on
                    reason = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:500]}"
            if reason is not None:
                print(f"  skipped {w.name} {setup} k={k} L={length} hit={hit}: {reason}", flush=True)
                skipped[w.name].append({**where, "batches": batches, "reason": reason})
            for x in ws:  # after every configuration: a run cut short keeps what it measured
                path = out_file(args, x)
                result = report(x, rows[x.name], skipped[x.name], header)
                path.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        fleet.close()
        client.close()
    for w in ws:
        print_table(f"{w.name} ({out_file(args, w)})", report(w, rows[w.name], [], header)["results"])
    print(f"\n{time.monotonic() - started:.0f} s; service logs in {fleet.logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
