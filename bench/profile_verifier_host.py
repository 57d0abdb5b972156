"""Where the verifier's host time goes per verify round, with model compute made negligible.

Both services run in-process over real gRPC on 127.0.0.1, each on its own event-loop thread, with the tiny
random target and the bigram EAGLE head of tests/test_services_e2e.py (SmolLM2's 49152-token vocabulary, so
the sampler and the lm_head rows are real-sized; 4 layers of width 64, so the forward costs next to nothing).
`--streams` requests at a time generate greedily while cProfile records three threads: the verifier's event
loop (scheduler, alignment, drafter link, streaming) and engine worker (forward, sampler, features), and the
drafter's event loop (the Draft stream, and each step's updates, drafting and DraftResult, run on it).
`--target-only` starts no drafter (k = 0): the verifier's two threads alone, each round a decode step.
`--colocated` puts the same drafter inside the verifier's process behind the in-process link, its serial
steps run on the verifier's loop as on a GPU (specwire.colocated; use with --cache-branches 0). As in
the services, the loops are uvloop's and the switch interval 0.2 ms; torch computes on one thread, so the
forward holds the worker's core as a GPU would and leaves the other to the event loop.

Prints per thread the top functions by cumulative ms per verify round, then a component summary. The default
timer is each thread's CPU time (`--timer cpu`), so time spent waiting (for the drafter, the other thread, or
other processes on a shared host) is not counted; `--timer wall` counts it; `--timer off` profiles nothing,
for wall figures without the profiler's overhead (and the only timer on Python 3.12+, where cProfile is one
per process). Target-only runs also time the engine's own step (decode,
sampler, tokens read back) at the same batch: what a round costs beyond it is the verifier's host time.

    python bench/profile_verifier_host.py                      # CPU
    python bench/profile_verifier_host.py --target-only --streams 16 --timer off
    python bench/profile_verifier_host.py --verifier-device cuda:1 --drafter-device cuda:0 \
        --out bench/results/profile_verifier_host_h200x2.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pathlib
import pstats
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
import uvloop

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported, as tests/conftest.py

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from profile_verify_step import sample, timed  # noqa: E402
from specwire.verifier.core_socket import SplitVerifier  # noqa: E402
from specwire.verifier.frontend import command as frontend_command  # noqa: E402
from specwire.verifier.scheduler import SchedulerConfig  # noqa: E402
from specwire.verifier.server import VerifierServer, VerifierSettings  # noqa: E402
from test_services_e2e import (  # noqa: E402
    MAX_CONTEXT,
    Drafter,
    Loop,
    colocated,
    poll,
    prompts,
    serving,
    tiny_target,
)

from specwire import grpc_common  # noqa: E402
from specwire.commands.demo import free_port  # noqa: E402
from specwire.default_model import default_model_path  # noqa: E402
from specwire.engine import TargetEngine  # noqa: E402
from specwire.metrics import VerifierMetrics  # noqa: E402
from specwire.tokenizer import load_tokenizer  # noqa: E402
from specwire.v1 import generation_pb2 as pb  # noqa: E402
from specwire.v1 import generation_pb2_grpc  # noqa: E402

# (label, thread, functions whose cumulative time it is); an indented label is part of the one above it.
COMPONENTS = [
    ("worker: _verify_on_worker (all)", "worker", ["_verify_on_worker"]),
    ("worker:   engine.verify/decode", "worker", ["verify", "decode"]),
    ("worker:     model step (eager forward, or graph prepare + replay)", "worker", ["_step"]),
    ("worker:   _sample (all)", "worker", ["_sample"]),
    ("worker:     rejection_sample", "worker", ["rejection_sample"]),
    ("worker: _settle_round (rounds without drafts settle here)", "worker", ["_settle_round"]),
    ("loop: Scheduler._round (all, minus awaits)", "loop", ["_round"]),
    ("loop:   _settle_round", "loop", ["_settle_round"]),
    ("loop:   _drafts_for", "loop", ["_drafts_for"]),
    ("loop:     read_result", "loop", ["read_result"]),
    ("loop:     batch_drafts", "loop", ["batch_drafts"]),
    ("loop:   _settle (append tokens, finish)", "loop", ["_settle"]),
    ("loop:   _stream (detokenise, queue)", "loop", ["_stream"]),
    ("loop:   _send_step", "loop", ["_send_step"]),
    ("loop:     _features (encode)", "loop", ["_features"]),
    ("loop:     DrafterLink.send", "loop", ["send"]),
    ("loop: DrafterLink._read", "loop", ["_read"]),
    ("loop: GenerationService.Generate", "loop", ["Generate"]),
    ("loop: Scheduler._reap", "loop", ["_reap"]),
    ("drafter loop: DrafterService._serve_stream (all, minus awaits)", "drafter_loop", ["_serve_stream"]),
    ("drafter loop:   _StepReader.next", "drafter_loop", ["next"]),
    ("drafter loop: run_step (all)", "drafter_loop", ["run_step"]),
    ("drafter loop:   _apply (decode features, proposer add/update)", "drafter_loop", ["_apply"]),
    ("drafter loop:   _propose", "drafter_loop", ["_propose"]),
    ("drafter loop:     EagleProposer.propose", "drafter_loop", ["propose"]),
    ("drafter loop:     _split (the DraftResult)", "drafter_loop", ["_split"]),
]
OWNERS = {  # function name -> a path fragment of its file, to tell apart same-named functions
    "_verify_on_worker": "scheduler", "verify": "engine", "decode": "engine", "_step": "engine",
    "_sample": "scheduler", "rejection_sample": "rejection_sampler",
    "_round": "scheduler", "_drafts_for": "scheduler", "read_result": "alignment",
    "batch_drafts": "alignment", "_settle": "scheduler", "_stream": "scheduler", "_send_step": "scheduler",
    "_features": "scheduler", "_settle_round": "scheduler",
    "send": "drafter_link", "_read": "drafter_link", "Generate": "verifier_service/server",
    "_reap": "scheduler", "_serve_stream": "drafter_service/server", "next": "drafter_service/server",
    "run_step": "drafter_service/server", "_apply": "drafter_service/server",
    "_propose": "drafter_service/server", "propose": "proposer", "_split": "drafter_service/server",
}


def start_verifier(loop: Loop, checkpoint, tokenizer, drafter_port: int | None, device: str, k: int,
                   max_slots: int, cache_branches: int = SchedulerConfig.cache_branches,
                   drafter_socket: str | None = None, in_process: bool = False, drafting_epoch: int = 0,
                   queue_drafts: bool | None = None, stream_interval: int = 1, frontend: str = "inline"
                   ) -> tuple[VerifierServer | SplitVerifier, generation_pb2_grpc.GenerationStub]:
    """As `specwire verifier` builds it: CUDA graphs for decode and for verify rows of 1 + k tokens.
    drafter_port None: target-only, unless in_process (the drafter in this process, on the CPU);
    drafter_socket: the Draft stream over the drafter's step socket; drafting_epoch and queue_drafts as
    SchedulerConfig's, as is stream_interval; frontend "process": the client streams served by a
    `specwire verifier-frontend` process, as `specwire verifier --frontend process` runs."""
    engine = TargetEngine(checkpoint=checkpoint, device=device, dtype=torch.float32, max_slots=max_slots,
                          max_context=MAX_CONTEXT, max_verify_tokens=k + 1)
    drafter = None if drafter_port is None else f"127.0.0.1:{drafter_port}"
    settings = VerifierSettings(drafter=drafter, drafter_socket=drafter_socket, step_timeout=5.0,
                                model_name="tiny",
                                scheduler=SchedulerConfig(num_speculative_tokens=k, max_waiting=64,
                                                          cache_branches=cache_branches,
                                                          drafting_epoch=drafting_epoch,
                                                          queue_drafts=queue_drafts,
                                                          stream_interval=stream_interval))

    async def start() -> tuple[VerifierServer | SplitVerifier, int]:  # grpc.aio objects live on their loop
        metrics = VerifierMetrics()
        link = colocated(checkpoint, tokenizer, metrics, inline=True) if in_process else None
        if frontend == "process":
            options = grpc_common.ServerOptions(listen=f"127.0.0.1:{free_port()}")
            split = SplitVerifier(options, settings, metrics, frontend_command(options, "WARNING", "text"))
            await split.start(engine, tokenizer, link, settings.model_name)
            return split, int(options.listen.rsplit(":", 1)[1])
        server = VerifierServer(grpc_common.ServerOptions(listen="127.0.0.1:0"), settings, metrics)
        return server, await server.start(engine, tokenizer, link)

    server, port = loop.run(start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    poll(lambda: serving(channel), timeout=60, what="the verifier SERVING")
    return server, generation_pb2_grpc.GenerationStub(channel)


def stop_verifier(loop: Loop, server: VerifierServer | SplitVerifier) -> None:
    loop.run(server.stop() if isinstance(server, SplitVerifier) else server.stop(0))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of another process so far (/proc/PID/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generate(stub, prompt: list[int], max_tokens: int) -> int:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return sum(len(r.chunk.token_ids) for r in stub.Generate(request, timeout=600))


def run_batches(stub, batch: list[list[int]], streams: int, max_tokens: int) -> int:
    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(lambda p: generate(stub, p, max_tokens), batch))


def on_threads(threads: dict[str, Loop | ThreadPoolExecutor], fn) -> None:
    """Runs fn(name) on each named event-loop thread or single-thread worker."""
    for name, thread in threads.items():
        if isinstance(thread, Loop):
            done = threading.Event()
            thread.loop.call_soon_threadsafe(lambda name=name, done=done: (fn(name), done.set()))
            assert done.wait(10), f"the {name} thread did not answer"
        else:
            thread.submit(fn, name).result()


def cumulative(stats: pstats.Stats, name: str) -> tuple[float, int]:
    """(cumulative seconds, calls) of the functions called `name` in the file OWNERS names."""
    seconds, calls = 0.0, 0
    for (path, _, func), (_, nc, _, ct, _) in stats.stats.items():
        if func == name and OWNERS[name] in path:
            seconds, calls = seconds + ct, calls + nc
    return seconds, calls


def top_rows(stats: pstats.Stats, rounds: int, n: int) -> list[dict]:
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])
    return [{"function": f"{pathlib.Path(path).name}:{line}({func})", "calls_per_round": nc / rounds,
             "self_ms": 1e3 * tt / rounds, "cum_ms": 1e3 * ct / rounds}
            for (path, line, func), (_, nc, tt, ct, _) in rows[:n]]


def verify_rounds(metrics: VerifierMetrics) -> tuple[int, float]:
    """Verifications so far and their seconds on the worker (verify_step_seconds' count and sum)."""
    samples = {s.name.rsplit("_", 1)[1]: s.value for s in metrics.verify_step_time.collect()[0].samples}
    return int(samples["count"]), samples["sum"]


def engine_step_ms(engine: TargetEngine, batch: int, iters: int = 200) -> tuple[float, float]:
    """The engine's own decode step at this batch (forward, sampler, tokens read back): median wall ms and
    mean CPU ms of this thread. Runs on slots 0..batch-1 at position 64, free once the requests are done."""
    slots, starts = list(range(batch)), [64] * batch
    cpu = time.thread_time()
    with torch.inference_mode():
        wall = timed(lambda: sample(engine.decode(slots, [5] * batch, starts).logits, batch, 0), iters)
    return wall, 1e3 * (time.thread_time() - cpu) / (iters + 5)  # timed() runs 5 warm-up calls first


def cpu_seconds(threads: dict[str, threading.Thread]) -> dict[str, float]:
    """CPU seconds so far of each thread, and of the whole process ("process")."""
    clocks = {name: time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for name, t in threads.items()}
    return clocks | {"process": time.process_time()}


class RoundGaps:
    """Times, on the worker, from the end of one verification (its tokens read back) to the start of the
    next: the host work between two rounds (settling, streaming, launching the next round: on the loop, or
    on the worker for rounds without drafts), which a device would sit idle through. Wraps the scheduler's
    _verify_on_worker."""

    def __init__(self, scheduler):
        self.gaps: list[float] = []
        self._ended: float | None = None
        verify = scheduler._verify_on_worker

        def timed_verify(*args):
            started = time.perf_counter()
            if self._ended is not None:
                self.gaps.append(started - self._ended)
            try:
                return verify(*args)
            finally:
                self._ended = time.perf_counter()

        scheduler._verify_on_worker = timed_verify

    def ms(self, q: float) -> float:
        """The q-quantile of the gaps, in ms (gaps after a prefill, or between requests, are the tail)."""
        return 1e3 * sorted(self.gaps)[int(q * (len(self.gaps) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier-device", default="cpu")
    p.add_argument("--drafter-device", default="cpu")
    p.add_argument("--streams", type=int, default=1, help="requests generating at once (default 1)")
    p.add_argument("--requests", type=int, default=8, help="requests in the profiled run (default 8)")
    p.add_argument("--max-tokens", type=int, default=96, help=f"per request (prompt + this <= {MAX_CONTEXT})")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--target-only", action="store_true", help="no drafter: k = 0, every round a decode step")
    p.add_argument("--cache-branches", type=int, default=SchedulerConfig.cache_branches,
                   help="the verifier's --cache-branches (0: serial drafting, each round waits for drafts)")
    p.add_argument("--drafting-epoch", type=int, default=0,
                   help="the verifier's --drafting-epoch (rounds an adaptive epoch; 0: tables only)")
    p.add_argument("--queue-drafts", choices=("auto", "on", "off"), default="auto",
                   help="the verifier's --queue-drafts (auto: where the drafter is on CUDA)")
    p.add_argument("--step-socket", action="store_true",
                   help="the Draft stream over the drafter's Unix step socket instead of gRPC")
    p.add_argument("--colocated", action="store_true",
                   help="the drafter in the verifier's process (serial steps on its loop); on the CPU")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the verifier's --stream-interval (tokens a stream's chunk gathers; default 1)")
    p.add_argument("--frontend", choices=("inline", "process"), default="inline",
                   help="the verifier's --frontend: the client streams on its loop, or in a front-end "
                        "process (whose CPU a round is then reported beside the threads')")
    p.add_argument("--timer", choices=("cpu", "wall", "off"), default="cpu")
    p.add_argument("--switch-interval", type=float, default=grpc_common.DEFAULT_SWITCH_INTERVAL,
                   help="sys.setswitchinterval, as the services set it (default %(default)s s)")
    p.add_argument("--top", type=int, default=30, help="rows per thread in the function table")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    if args.timer != "off" and sys.version_info >= (3, 12):  # cProfile is one per process there
        raise SystemExit("per-thread profiles need Python 3.11; on 3.12+ use --timer off (the gaps between "
                         "rounds, no profile) or bench/bench_services.py's per-round breakdown")

    if args.target_only:
        args.k = 0
    sys.setswitchinterval(args.switch_interval)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # the services' loop (grpc_common.run)
    torch.set_num_threads(1)  # the forward stays on the worker's core, as on a GPU; the other is the loop's
    checkpoint = tiny_target()
    tokenizer = load_tokenizer(default_model_path())
    verifier_loop = Loop()
    drafter_loop = drafter = None
    socket_path = None
    if args.step_socket and not args.target_only:
        socket_path = str(pathlib.Path(tempfile.mkdtemp(prefix="specwire-host-")) / "drafter.sock")
    if not args.target_only and not args.colocated:
        drafter_loop = Loop()
        drafter = Drafter(drafter_loop, checkpoint, tokenizer.fingerprint, device=args.drafter_device,
                          step_socket=socket_path)
    server, stub = start_verifier(verifier_loop, checkpoint, tokenizer, drafter and drafter.port,
                                  args.verifier_device, args.k, max_slots=max(16, args.streams),
                                  cache_branches=args.cache_branches, drafter_socket=socket_path,
                                  in_process=args.colocated and not args.target_only,
                                  drafting_epoch=args.drafting_epoch,
                                  queue_drafts={"on": True, "off": False}.get(args.queue_drafts),
                                  stream_interval=args.stream_interval, frontend=args.frontend)
    scheduler = server.scheduler
    deadline = time.time() + 30
    while (drafter or args.colocated) and not scheduler.speculating:
        assert time.time() < deadline, "the drafter never connected"
        time.sleep(0.05)
    batch = prompts(args.requests, seed=1)
    run_batches(stub, batch[:args.streams], args.streams, 16)  # warm-up: graphs, allocator, grpc channels

    timer = {"cpu": time.thread_time, "wall": time.perf_counter}.get(args.timer)
    threads = {"loop": verifier_loop, "worker": scheduler._worker}
    if drafter:
        threads |= {"drafter_loop": drafter_loop}  # the drafter drafts on its loop (fdb547f)
    profiles = {name: cProfile.Profile(timer) for name in threads} if timer else {}
    metrics = server.metrics
    steps_before = metrics.num_draft_tokens._value.get(), metrics.num_accepted_tokens._value.get()
    rounds_before, verify_before = verify_rounds(metrics)
    os_threads = {"loop": verifier_loop.thread, "worker": next(iter(scheduler._worker._threads))}
    frontend_pid = server.process.pid if args.frontend == "process" else None
    cpu_before = cpu_seconds(os_threads)
    if frontend_pid:
        cpu_before["frontend_process"] = process_cpu_seconds(frontend_pid)
    gaps = RoundGaps(scheduler)
    on_threads({name: threads[name] for name in profiles}, lambda name: profiles[name].enable())
    started = time.perf_counter()
    tokens = run_batches(stub, batch, args.streams, args.max_tokens)
    seconds = time.perf_counter() - started
    cpu_after = cpu_seconds(os_threads)
    if frontend_pid:
        cpu_after["frontend_process"] = process_cpu_seconds(frontend_pid)
    cpu = {name: seconds_now - cpu_before[name] for name, seconds_now in cpu_after.items()}
    on_threads({name: threads[name] for name in profiles}, lambda name: profiles[name].disable())

    stats = {thread: pstats.Stats(prof) for thread, prof in profiles.items()}
    rounds, verify_seconds = verify_rounds(metrics)
    rounds, verify_seconds = rounds - rounds_before, verify_seconds - verify_before
    drafted = metrics.num_draft_tokens._value.get() - steps_before[0]
    accepted = metrics.num_accepted_tokens._value.get() - steps_before[1]
    summary = {
        "rounds": rounds, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ms_per_round_wall": 1e3 * seconds / rounds, "tokens_per_round": tokens / rounds,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        **{f"cpu_ms_per_round_{name}": 1e3 * c / rounds for name, c in cpu.items()},
        "gap_ms_median": gaps.ms(0.5), "gap_ms_p90": gaps.ms(0.9),
        "verify_ms_mean": 1e3 * verify_seconds / rounds,  # on the worker: forward, sampler, tokens read back
    }
    print(f"# {rounds} verify rounds, {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} tok/s, "
          f"{summary['ms_per_round_wall']:.2f} ms a round wall, {tokens / rounds:.2f} tokens a round); "
          f"timer: {args.timer} time per thread, ms per verify round")
    print(f"# between rounds (a verification's end to the next one's start): median {gaps.ms(0.5):.3f} ms, "
          f"p90 {gaps.ms(0.9):.3f} ms; a verification on the worker: {summary['verify_ms_mean']:.3f} ms mean")
    print("# CPU ms a round: " + ", ".join(f"{name} {1e3 * c / rounds:.3f}" for name, c in cpu.items()))
    if args.target_only:
        wall, cpu_ms = engine_step_ms(scheduler.engine, args.streams)
        summary |= {"engine_step_ms": wall, "engine_step_cpu_ms": cpu_ms,
                    "ms_per_round_beyond_engine_step": summary["ms_per_round_wall"] - wall,
                    "worker_cpu_ms_beyond_engine_step": summary["cpu_ms_per_round_worker"] - cpu_ms}
        print(f"# the engine's own step: {wall:.3f} ms (median), {cpu_ms:.3f} ms CPU; a round costs "
              f"{summary['ms_per_round_beyond_engine_step']:.3f} ms more wall, the worker "
              f"{summary['worker_cpu_ms_beyond_engine_step']:.3f} ms more CPU")
    tables = {}
    for thread, s in stats.items():
        tables[thread] = top_rows(s, rounds, args.top)
        total = 1e3 * s.total_tt / rounds
        print(f"\n## {thread} thread: {total:.3f} ms a round in all")
        print(f"{'cum ms':>8} {'self ms':>8} {'calls':>7}  function")
        for r in tables[thread]:
            print(f"{r['cum_ms']:8.3f} {r['self_ms']:8.3f} {r['calls_per_round']:7.2f}  {r['function']}")
    components = {}
    print("\n## components (ms per verify round; indented rows are part of the row above)")
    for label, thread, names in [c for c in COMPONENTS if c[1] in stats]:
        seconds_in = sum(cumulative(stats[thread], name)[0] for name in names)
        components[label] = 1e3 * seconds_in / rounds
        print(f"{components[label]:8.3f}  {label}")
    for thread, s in stats.items():
        components[f"{thread}: thread total"] = 1e3 * s.total_tt / rounds
        print(f"{components[f'{thread}: thread total']:8.3f}  {thread}: thread total")

    stop_verifier(verifier_loop, server)
    if drafter:
        drafter.kill()
        drafter_loop.close()
    verifier_loop.close()
    if args.out:
        result = {"bench": "profile_verifier_host", "args": vars(args), "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "summary": summary, "components_ms_per_round": components, "top": tables}
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
