"""The services' own Prometheus /metrics, scraped before and after a measurement: where a round's time goes,
the speculation cache's hit rate and the bytes on the drafter link, as differences between two scrapes.

Families read (absent ones give None, so the bench runs against older or newer services alike):
- verifier: specwire_verify_step_seconds (engine-thread time of one step: forward, sampling, readback),
  specwire_drafter_rpc_latency_seconds (DraftStep sent to its result received), specwire_drafter_rpc_bytes
  {direction}, specwire_spec_cache_lookups{result="hit"|"miss"|"late"|"unasked"} (the speculation cache,
  when present), specwire_spec_cache_round{s,_seconds,_tokens}{mode} (its rounds by drafting mode);
  specwire_verify_gpu_idle_seconds{waiting_for} (the device's idle time before a verification);
- drafter: specwire_drafter_step_seconds (compute of one DraftStep).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specwire.metrics import DRAFTING_MODES, IDLE_CAUSES, JUST_IN_TIME_RESULTS, LOOKUP_RESULTS

Scrape = dict[str, float]  # 'name' or 'name{label="value",...}' -> value


def scrape(port: int | None) -> Scrape:
    """Every sample of a /metrics endpoint; labelled samples are keyed name{k="v",...} (labels sorted)."""
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class Delta:
    """What changed between two scrapes of each service ('verifier', 'drafter')."""

    def __init__(self, before: dict[str, Scrape], after: dict[str, Scrape]):
        self.before, self.after = before, after

    def get(self, service: str, sample: str) -> float | None:
        after = self.after.get(service, {})
        if sample not in after:
            return None
        return after[sample] - self.before.get(service, {}).get(sample, 0.0)

    def mean_ms(self, service: str, family: str) -> float | None:
        count, total = self.get(service, family + "_count"), self.get(service, family + "_sum")
        return 1e3 * total / count if count and total is not None else None


def round_split(delta: Delta, wall: float) -> dict[str, float | None]:
    """Per verification step, in ms: wall (measurement wall time / steps), verify (the verifier's engine
    thread), verify_gpu (its device time, from CUDA events; None on a CPU), drafter_round_trip (the RPC as
    the verifier timed it), draft (the drafter's compute), transport (round trip - draft: the gRPC hop and
    both services' Python around it) and host (wall - verify - the round trips' time per verification, which
    is less than one round trip where rounds send no step, as with drafts queued behind the sampler: the
    verifier's event loop and what the overlap did not hide; negative when drafting overlapped verification)
    and not_verify (wall - verify: everything on the critical path but the verification itself, whatever
    overlapped); gpu_idle_launch and gpu_idle_drafts (the verifier's device idle before a verification,
    waiting for its launch and for drafts written on the device; CUDA only)."""
    steps = delta.get("verifier", "specwire_verify_step_seconds_count")
    verify = delta.mean_ms("verifier", "specwire_verify_step_seconds")
    trip = delta.mean_ms("verifier", "specwire_drafter_rpc_latency_seconds")
    trips = delta.get("verifier", "specwire_drafter_rpc_latency_seconds_sum")
    draft = delta.mean_ms("drafter", "specwire_drafter_step_seconds")
    out = {"steps": steps, "wall": 1e3 * wall / steps if steps else None, "verify": verify,
           "verify_gpu": delta.mean_ms("verifier", "specwire_verify_gpu_seconds"),
           "drafter_round_trip": trip, "draft": draft,
           "transport": trip - draft if trip is not None and draft is not None else None}
    trips_per_step = 1e3 * trips / steps if trips is not None and steps else None
    known = [v for v in (verify, trips_per_step) if v is not None]
    out["host"] = out["wall"] - sum(known) if out["wall"] is not None and known else None
    out["not_verify"] = out["wall"] - verify if out["wall"] is not None and verify is not None else None
    # The verifier's device idle before each verification (CUDA, a drafter process or none), per verification
    # measured: waiting for the round's launch, and for drafts written on the device.
    # None where no gap was measured at all: beside a co-located drafter, whose work runs in the gaps.
    measured = delta.get("verifier", "specwire_verify_gpu_seconds_count")
    gaps = any(delta.get("verifier", f'specwire_verify_gpu_idle_seconds_count{{waiting_for="{cause}"}}')
               for cause in IDLE_CAUSES)
    for cause in IDLE_CAUSES:
        idle = delta.get("verifier", f'specwire_verify_gpu_idle_seconds_sum{{waiting_for="{cause}"}}')
        out[f"gpu_idle_{cause}"] = 1e3 * idle / measured if idle is not None and measured and gaps else None
    return out


def rows_per_verification(delta: Delta) -> float | None:
    """Requests a verification ran on average (specwire_verified_rows_total over the verifications; None
    where the verifier does not count them)."""
    rows = delta.get("verifier", "specwire_verified_rows_total")
    steps = delta.get("verifier", "specwire_verify_step_seconds_count")
    return rows / steps if rows is not None and steps else None


def prefill_split(delta: Delta, wall: float) -> dict[str, float | None]:
    """The verifier's prefill steps: how many, ms each (engine thread) and their share of the wall time; and
    the prompts verifications carried instead (`carried`)."""
    steps = delta.get("verifier", "specwire_prefill_step_seconds_count")
    total = delta.get("verifier", "specwire_prefill_step_seconds_sum")
    share = total / wall if total is not None and wall > 0 else None
    return {"steps": steps, "ms": delta.mean_ms("verifier", "specwire_prefill_step_seconds"), "share": share,
            "carried": delta.get("verifier", "specwire_prompts_carried_total")}


def cache_hit_rate(delta: Delta) -> dict[str, float | None] | None:
    """Speculation-cache lookups by result and the hit share of those with a table to look in (unasked: none
    was asked for), the queued rounds whose drafts were tables ahead, what the drafts made just in time for
    requests without table drafts came to, and the rounds by drafting mode (serial: an adaptive verifier's
    serial epochs); None when the verifier has no cache."""
    family = "specwire_spec_cache_lookups_total"
    counts = {r: delta.get("verifier", f'{family}{{result="{r}"}}') for r in LOOKUP_RESULTS}
    if all(v is None for v in counts.values()):
        return None
    total = sum(counts[r] or 0.0 for r in ("hit", "miss", "late"))
    family = "specwire_spec_cache_just_in_time_total"
    just_in_time = {r: delta.get("verifier", f'{family}{{result="{r}"}}') for r in JUST_IN_TIME_RESULTS}
    by_mode = {name: {m: delta.get("verifier", f'specwire_spec_cache_{name}_total{{mode="{m}"}}')
                      for m in DRAFTING_MODES} for name in ("rounds", "round_seconds", "round_tokens")}
    rounds, seconds, tokens = by_mode["rounds"], by_mode["round_seconds"], by_mode["round_tokens"]
    return {**counts, "hit_rate": (counts["hit"] or 0.0) / total if total else None,
            "tables_ahead_served": delta.get("verifier", "specwire_queued_tables_served_total"),
            "just_in_time": just_in_time, "rounds": rounds,
            "round_ms": {m: 1e3 * seconds[m] / rounds[m] if rounds[m] and seconds[m] is not None else None
                         for m in DRAFTING_MODES},
            "tokens_per_round": {m: tokens[m] / rounds[m] if rounds[m] and tokens[m] is not None else None
                                 for m in DRAFTING_MODES}}


def wire_bytes_per_step(delta: Delta) -> dict[str, float | None]:
    """Draft-stream bytes per verification step, as the verifier counted them."""
    steps = delta.get("verifier", "specwire_verify_step_seconds_count")
    out = {}
    for direction in ("sent", "received"):
        sent = delta.get("verifier", f'specwire_drafter_rpc_bytes_total{{direction="{direction}"}}')
        out[direction] = sent / steps if sent is not None and steps else None
    return out
