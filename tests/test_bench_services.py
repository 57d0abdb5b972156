"""bench/bench_services.py on the CPU: a smoke run of the harness on the tiny synthetic shape, and its
arithmetic (percentiles, a round's time split, the cache hit rate, bytes per step) on made-up scrapes; and
short runs of bench/bench_link_round_trip.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from services_client import percentiles_ms  # noqa: E402  (bench/ is not a package)
from services_metrics import (  # noqa: E402
    Delta,
    cache_hit_rate,
    prefill_split,
    round_split,
    rows_per_verification,
    wire_bytes_per_step,
)
from services_table import modes_table  # noqa: E402

VERIFY, TRIP = "specwire_verify_step_seconds", "specwire_drafter_rpc_latency_seconds"


def test_percentiles_are_nearest_rank_in_ms():
    got = percentiles_ms([i / 1000 for i in range(1, 101)])
    assert got == pytest.approx({"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5})
    assert percentiles_ms([]) is None


def test_round_split_cache_and_bytes_from_two_scrapes():
    draft = "specwire_drafter_step_seconds"
    before = {"verifier": {f"{VERIFY}_count": 10, f"{VERIFY}_sum": 0.01, f"{TRIP}_count": 10,
                           f"{TRIP}_sum": 0.01},
              "drafter": {f"{draft}_count": 0, f"{draft}_sum": 0.0}}
    after = {"verifier": {f"{VERIFY}_count": 110, f"{VERIFY}_sum": 0.21, f"{TRIP}_count": 110,
                          "specwire_verify_gpu_seconds_count": 100, "specwire_verify_gpu_seconds_sum": 0.16,
                          f"{TRIP}_sum": 0.16, 'specwire_drafter_rpc_bytes_total{direction="sent"}': 5000.0,
                          'specwire_spec_cache_lookups_total{result="hit"}': 75.0,
                          'specwire_spec_cache_lookups_total{result="miss"}': 25.0,
                          'specwire_spec_cache_just_in_time_total{result="drafted"}': 20.0,
                          # an adaptive verifier: 80 rounds without drafts (1.5 ms, one token each), 20 serial
                          'specwire_spec_cache_rounds_total{mode="none"}': 80.0,
                          'specwire_spec_cache_round_seconds_total{mode="none"}': 0.12,
                          'specwire_spec_cache_round_tokens_total{mode="none"}': 80.0,
                          'specwire_spec_cache_rounds_total{mode="serial"}': 20.0,
                          'specwire_spec_cache_round_seconds_total{mode="serial"}': 0.1,
                          'specwire_spec_cache_round_tokens_total{mode="serial"}': 50.0,
                          # the device idle 0.5 ms before each verification for its launch; 0.2 ms for drafts
                          'specwire_verify_gpu_idle_seconds_sum{waiting_for="launch"}': 0.05,
                          'specwire_verify_gpu_idle_seconds_sum{waiting_for="drafts"}': 0.02,
                          'specwire_verify_gpu_idle_seconds_count{waiting_for="launch"}': 99.0,
                          'specwire_verify_gpu_idle_seconds_count{waiting_for="drafts"}': 60.0},
             "drafter": {f"{draft}_count": 100, f"{draft}_sum": 0.05}}
    delta = Delta(before, after)
    split = round_split(delta, wall=0.5)  # 100 steps in 0.5 s
    assert split == pytest.approx({"steps": 100, "wall": 5.0, "verify": 2.0, "verify_gpu": 1.6,
                                   "drafter_round_trip": 1.5,
                                   "draft": 0.5, "transport": 1.0, "host": 1.5, "not_verify": 3.0,
                                   "gpu_idle_launch": 0.5, "gpu_idle_drafts": 0.2})
    # Beside a co-located drafter no gap is idle time: none measured, none shown (not 0)
    colocated = {"verifier": after["verifier"] | {
        f'specwire_verify_gpu_idle_seconds_{part}{{waiting_for="{cause}"}}': 0.0
        for part in ("sum", "count") for cause in ("launch", "drafts")}}
    got = round_split(Delta(before, colocated), wall=0.5)
    assert got["gpu_idle_launch"] is None and got["gpu_idle_drafts"] is None and got["verify_gpu"] == 1.6
    # Drafts queued behind the sampler: only the 10 steps of new requests went to the drafter (2 ms each), so
    # the round trips take 0.2 ms a verification, not 2 ms
    queued = {"verifier": after["verifier"] | {f"{TRIP}_count": 20, f"{TRIP}_sum": 0.03}}
    got = round_split(Delta(before, queued), wall=0.5)
    assert got["drafter_round_trip"] == pytest.approx(2.0) and got["host"] == pytest.approx(5.0 - 2.0 - 0.2)
    cache = cache_hit_rate(delta)
    assert cache.pop("just_in_time") == {"drafted": 20.0, "undrafted": None, "late": None, "declined": None}
    assert cache.pop("rounds") == {"tables": None, "serial": 20.0, "none": 80.0}
    assert cache.pop("round_ms") == pytest.approx({"tables": None, "serial": 5.0, "none": 1.5})
    assert cache.pop("tokens_per_round") == pytest.approx({"tables": None, "serial": 2.5, "none": 1.0})
    assert cache.pop("tables_ahead_served") is None  # (no queued tables in these scrapes)
    assert cache == pytest.approx({"hit": 75, "miss": 25, "late": None, "unasked": None, "hit_rate": 0.75})
    assert cache_hit_rate(Delta(before, before)) is None
    assert wire_bytes_per_step(delta) == {"sent": 50.0, "received": None}
    assert prefill_split(delta, wall=0.5) == {"steps": None, "ms": None, "share": None,  # no prefill metric
                                              "carried": None}
    prefill = "specwire_prefill_step_seconds"
    after["verifier"] |= {f"{prefill}_count": 4.0, f"{prefill}_sum": 0.02,
                          "specwire_prompts_carried_total": 3.0}
    got = prefill_split(Delta(before, after), wall=0.5)
    assert got == pytest.approx({"steps": 4, "ms": 5.0, "share": 0.04, "carried": 3})
    # 100 verifications of 1,150 rows: a batch of 16 whose tail ran at fewer rows
    assert rows_per_verification(delta) is None  # (a verifier before the counter)
    after["verifier"]["specwire_verified_rows_total"] = 1150.0
    assert rows_per_verification(Delta(before, after)) == pytest.approx(11.5)


def test_the_drafting_modes_table_lists_the_points_that_timed_their_rounds():
    """Below the main table: each cached point's rounds by mode, their mean ms and tokens; points without a
    cache, of another temperature, or from files before the per-mode counters are left out."""
    timed = {"rounds": {"tables": 64.0, "serial": 32.0, "none": 1880.0},
             "round_ms": {"tables": 2.04, "serial": 7.61, "none": 1.4},
             "tokens_per_round": {"tables": 1.0, "serial": 2.75, "none": 1.0}}
    older = {"rounds": {"tables": 10.0, "serial": 0.0, "none": 0.0}}  # written before session 31's counters
    point = {"setup": "two_gpus", "forced_hit_rate": "adaptive", "batch": 1, "load": "batch",
             "temperature": 1.0}
    report = {"results": [point | {"cache": timed}, point | {"cache": older, "batch": 16},
                          point | {"cache": timed, "temperature": 0.0},
                          {"setup": "target_only", "batch": 1, "temperature": 1.0, "cache": None}]}
    lines = modes_table(report, temperature=1.0).splitlines()
    assert lines[2:] == ["| two_gpus | adaptive | 1 | batch | 64 / 32 / 1880 | 2.04 / 7.61 / 1.40 | "
                         "1.00 / 2.75 / 1.00 |"]
    assert modes_table(report, temperature=1.0, setups=["target_only"]) == ""


def test_greedy_outputs_are_compared_and_each_mismatch_located():
    from bench_services import compare

    def row(setup: str, outputs: list[list[int]]) -> dict:
        return {"setup": setup, "temperature": 0.0, "_outputs": outputs, "tokens_per_s": 10.0,
                "round_ms": {"steps": 0}, "tokens": 8, "requests": 2}

    base = row("target_only", [[1, 2, 3, 4, 5], [6, 7, 8]])
    same = compare(row("colocated", [[1, 2, 3, 4, 5], [6, 7, 8]]), base, real_model=True)
    assert same["output_equal_rate"] == 1.0 and same["output_mismatches"] == []
    parted = compare(row("colocated", [[1, 2, 3, 4, 5], [6, 9, 8]]), base, real_model=True)
    assert parted["output_equal_rate"] == 0.5
    mismatch = {"request": 1, "position": 1, "got": [9, 8], "target_only": [7, 8]}
    assert parted["output_mismatches"] == [mismatch]


def test_a_paired_point_is_compared_with_the_target_only_batches_run_between_its_own():
    """--paired: speedup and output equality against the target-only batches alternated with the point's
    (same prompts); the ratio to the run's target-only row stays beside it as speedup_unpaired."""
    from bench_services import compare

    base = {"setup": "target_only", "temperature": 0.0, "_outputs": [[1, 2], [3, 4]], "tokens_per_s": 10.0,
            "round_ms": {"steps": 0}, "tokens": 4, "requests": 2}
    row = base | {"setup": "two_gpus_socket", "tokens_per_s": 18.0, "_outputs": [[1, 2], [3, 5]],
                  "paired_target": {"tokens_per_s": 12.0}, "_paired_outputs": [[1, 2], [3, 5]]}
    got = compare(row, base, real_model=True)
    assert got["speedup"] == pytest.approx(1.5) and got["speedup_unpaired"] == pytest.approx(1.8)
    assert got["output_equal_rate"] == 1.0  # against the paired outputs, not the row's
    alone = compare(row, None, real_model=True)  # no target-only row in the run
    assert alone["speedup"] == pytest.approx(1.5) and alone["speedup_unpaired"] is None


def test_the_ideal_speedup_from_engine_thread_and_from_device_time():
    """tau * t_target / t_verify as decode tokens per second of verification, against target-only's: from
    the engine thread's time, and (CUDA) from the device's."""
    from bench_services import compare

    def row(setup: str, tokens_per_s: float, tokens: int, steps: int, thread: float, gpu: float | None
            ) -> dict:
        return {"setup": setup, "temperature": 1.0, "batch": 4, "tokens_per_s": tokens_per_s,
                "tokens": tokens, "requests": 4, "round_ms": {"steps": steps}, "_step_seconds": thread,
                "_gpu_seconds": gpu}

    base = row("target_only", 100.0, 404, 100, thread=0.5, gpu=0.4)  # 5 ms a step, 4 ms on the device
    # 3 decode tokens a row a verification (100 of them); the thread's 8 ms hold a 2 ms wait for drafts
    spec = compare(row("colocated", 250.0, 1204, 100, thread=0.8, gpu=0.6), base, real_model=False)
    assert spec["speedup"] == pytest.approx(2.5)
    assert spec["ideal_speedup"] == pytest.approx(3 * 5 / 8) and spec["t_verify_ms"] == pytest.approx(8.0)
    assert spec["ideal_speedup_gpu"] == pytest.approx(3 * 4 / 6) and spec["t_target_gpu_ms"] == 4.0
    assert spec["speedup_over_ideal_gpu"] == pytest.approx(2.5 / 2)
    on_cpu = compare(row("colocated", 250.0, 1204, 100, thread=0.8, gpu=None), base | {"_gpu_seconds": None},
                     real_model=False)
    assert "ideal_speedup" in on_cpu and "ideal_speedup_gpu" not in on_cpu
    assert "speedup_decode" not in spec  # no prefill split recorded


def test_the_speedup_over_decode_time_leaves_the_prefill_out():
    """Prefill is 10% of target-only's wall and 20% of the speculative run's: 2.0x overall is
    2.0 x 0.9 / 0.8 = 2.25x over the decode time alone."""
    from bench_services import compare

    def row(setup: str, tokens_per_s: float, share: float) -> dict:
        return {"setup": setup, "temperature": 0.0, "batch": 16, "tokens_per_s": tokens_per_s, "tokens": 0,
                "requests": 0, "round_ms": {"steps": 0}, "prefill": {"steps": 6, "ms": 70.0, "share": share}}

    got = compare(row("colocated", 200.0, 0.2), row("target_only", 100.0, 0.1), real_model=False)
    assert got["speedup"] == pytest.approx(2.0) and got["speedup_decode"] == pytest.approx(2.25)


def test_the_harness_runs_the_setups_side_by_side_on_the_cpu(tmp_path):
    """Target-only, two processes (over gRPC and over the step socket) and the co-located setups (the drafter
    on the verifier's device or on the drafter's: here both the CPU) on synthetic:tiny; one JSON with the
    schema the README reads. The verifiers wait for every table (a busy CI machine would otherwise see
    them all late, and no drafts)."""
    argv = [sys.executable, str(BENCH / "bench_services.py"), "--workloads", "synthetic", "--synthetic-shape",
            "tiny", "--lengths", "2", "--hit-rates", "1.0", "--setups",
            "target_only,two_gpus,two_gpus_socket,colocated,colocated_two_gpus",
            "--synthetic-verifier-args", "--draft-timeout 30 --table-wait-ms 30000",
            "--batch-sizes", "2", "--loads", "batch,sustained", "--chunk-times",
            "--temperatures", "0", "--sweep-ks", "", "--max-tokens", "12", "--repeats", "2",
            "--min-requests", "4", "--drafter-device", "cpu", "--verifier-device", "cpu",
            "--out-dir", str(tmp_path), "--tag", "t"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "services_tiny_synthetic_t.json").read_text())
    assert report["command"] and report["commit"] and report["machine"]["cpus"] and report["date"]
    sustained = {r["setup"]: r for r in report["results"] if r["load"] == "sustained"}
    rows = {r["setup"]: r for r in report["results"] if r["load"] == "batch"}
    assert rows["target_only"]["speedup"] == 1.0 and rows["target_only"]["batch"] == 2
    assert rows["two_gpus_socket"]["tokens"] == 48 and rows["two_gpus_socket"]["cache"]["hit"] > 0
    # Two lanes of two requests each: the same prompts, so the same greedy output as the static batches.
    assert sustained.keys() == rows.keys() and sustained["target_only"]["speedup"] == 1.0
    assert all(r["requests"] == 4 and r["tokens"] == 48 and r["batch"] == 2 for r in sustained.values())
    assert sustained["two_gpus"]["speedup"] > 0
    chunks = [json.loads(line) for line in (tmp_path / "chunks_t.jsonl").read_text().splitlines()]
    assert len(chunks) == 2 * len(rows)  # a line per point, its requests' chunk times
    lanes = next(c for c in chunks if c["setup"] == "target_only" and c["load"] == "sustained")["requests"]
    assert len(lanes) == 4 and all(len(r["arrivals"]) == len(r["tokens"]) >= 1 for r in lanes)
    assert all(sum(r["tokens"]) == 12 for r in lanes)
    # A lane sends its second request after its first has ended.
    assert lanes[2]["sent"] >= lanes[0]["sent"] + lanes[0]["arrivals"][-1]
    # One prefill step a request at most (a static batch's arrivals may share one), each timed.
    assert all(1 <= r["prefill"]["steps"] <= r["requests"] and r["prefill"]["ms"] > 0
               for r in report["results"])
    spec = rows["two_gpus"]
    assert spec["tokens"] == 48 and spec["k"] == 4 and spec["forced_acceptance_length"] == 2.0
    assert spec["forced_hit_rate"] == 1.0 and spec["cache"]["hit"] > 0
    assert spec["speedup"] > 0 and spec["ideal_speedup"] > 0 and spec["mean_acceptance_length"] > 1
    assert 0 < spec["tokens_per_verification"] <= spec["k"] + 1  # a verification gains at most k + 1 tokens
    assert spec["round_ms"]["verify"] > 0 and spec["round_ms"]["draft"] > 0
    assert spec["wire_bytes_per_step"]["sent"] > 0 and spec["ttft_ms"]["p50"] > 0
    assert report["skipped"] == []
    for setup in ("colocated", "colocated_two_gpus"):  # the drafter in the verifier's process, serving tables
        assert rows[setup]["tokens"] == 48 and rows[setup]["cache"]["hit"] > 0


def test_the_gpu_busy_share_keeps_no_samples_while_paused():
    """A --paired point's target-only batches are left out of its GPUs' busy share."""
    from gpu_busy import GpuBusy

    class Smi:  # nvidia-smi's lines, as GpuBusy reads them from its process
        stdout = ["0, 40\n", "1, 90\n"]

    busy = GpuBusy([0])
    with busy.paused():
        busy._read_smi(Smi)
    assert busy.samples[0] == []
    busy._read_smi(Smi)
    assert busy.samples == {0: [40.0]}


def test_paired_points_alternate_with_a_target_only_verifier_beside_them(tmp_path):
    """--paired on synthetic:tiny: the step-socket point's requests alternate with a second, target-only
    verifier's of the same prompts (batches between its batches; under sustained load, half before and half
    after), which the row reports; the GPUs' busy share (none on a CPU) aside."""
    argv = [sys.executable, str(BENCH / "bench_services.py"), "--workloads", "synthetic", "--synthetic-shape",
            "tiny", "--lengths", "2", "--hit-rates", "off", "--setups", "target_only,two_gpus_socket",
            "--paired", "--batch-sizes", "2", "--temperatures", "0", "--sweep-ks", "", "--max-tokens", "12",
            "--repeats", "3", "--min-requests", "2", "--loads", "batch,sustained", "--drafter-device", "cpu",
            "--verifier-device", "cpu", "--out-dir", str(tmp_path), "--tag", "p"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "services_tiny_synthetic_p.json").read_text())
    rows = {(r["setup"], r["load"]): r for r in report["results"]}
    for load in ("batch", "sustained"):
        spec, target = rows["two_gpus_socket", load], rows["target_only", load]
        paired = spec["paired_target"]
        assert paired["requests"] == spec["requests"] == 6 and paired["tokens"] == spec["tokens"] == 72
        assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / paired["tokens_per_s"])
        assert spec["speedup_unpaired"] == pytest.approx(spec["tokens_per_s"] / target["tokens_per_s"])
        assert "paired_target" not in target and target["speedup"] == 1.0


@pytest.mark.parametrize("mode", [[], ["--bare-grpc"], ["--step-socket"]])
def test_the_link_benchmark_times_real_round_trips(tmp_path, mode):
    """bench/bench_link_round_trip.py: every step answered (it asserts so), and through specwire the way out,
    the step and the way back add up to the round trip."""
    out = tmp_path / "link.json"
    argv = [sys.executable, str(BENCH / "bench_link_round_trip.py"), "--steps", "40", "--warmup", "5",
            "--out", str(out), *mode]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["steps"] == 40 and got["bare_grpc"] == (mode == ["--bare-grpc"])
    assert got["step_socket"] == (mode == ["--step-socket"])
    assert 0 < got["round_trip"]["p50_ms"] <= got["round_trip"]["p90_ms"] < 5000
    if mode != ["--bare-grpc"]:
        parts = sum(got[k]["mean_ms"] for k in ("way_out", "step", "way_back"))
        assert parts == pytest.approx(got["round_trip"]["mean_ms"])
        assert all(got[k]["p50_ms"] > 0 for k in ("way_out", "step", "way_back"))


def test_the_k_sweep_runs_last_on_the_setup_asked_for():
    import bench_services  # noqa: E402  (bench/ is not a package)

    def jobs(*argv: str) -> list[tuple]:
        args = bench_services.parse_args(["--workloads", "synthetic", "--lengths", "3", "--hit-rates", "off",
                                          "--ks", "4", "--sweep-ks", "2,3,4", "--sweep-batch-sizes", "1,16",
                                          *argv])
        return [(setup, k, sizes) for _, setup, k, _, _, sizes in
                bench_services.jobs(args, bench_services.workloads(args))]

    swept = jobs("--setups", "target_only,colocated,two_gpus", "--sweep-setup", "colocated")
    assert swept[-2:] == [("colocated", 2, [1, 16]), ("colocated", 3, [1, 16])]
    assert ("two_gpus", 2, [1, 16]) not in swept
    assert jobs("--setups", "target_only,two_gpus")[-1] == ("two_gpus", 3, [1, 16])  # the default
    assert all(k == 4 or setup == "target_only" for setup, k, _ in jobs("--setups", "target_only,colocated"))
    with pytest.raises(SystemExit):
        jobs("--setups", "target_only,colocated", "--sweep-setup", "target_only")


def test_small_batches_send_at_least_min_requests():
    import bench_services  # noqa: E402  (bench/ is not a package)

    assert bench_services.batches_per_point(1, 3, 16) == 16
    assert bench_services.batches_per_point(16, 3, 16) == 3
    assert bench_services.batches_per_point(5, 2, 16) == 4  # 20 requests: whole batches only
    assert bench_services.batches_per_point(64, 2, 0) == 2
