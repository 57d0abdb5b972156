"""What the verifier <-> drafter hop costs without any drafting: the real DrafterLink and DrafterService over
real gRPC on 127.0.0.1, each on its own uvloop event-loop thread (as in the services), with DraftSteps that
carry no updates and no wants, so the drafter's step does nothing.

The drafter's step records when it starts and ends (same process, same clock), which splits each round trip
into the way out (send -> the drafter starts the step: the verifier's writer task, gRPC, the drafter's reader
task, its queue), the step itself (on the drafter's loop since session 13), and the way back (the step's end
-> the verifier's future resolves: gRPC, the verifier's reader task). Both loops share this process's GIL
here.

--drafter-process: `specwire drafter` (the default model and head, on the CPU) in a process of its own, as
  deployed; only the round trip is measured then (its clock is not ours to read).
--busy-thread: a thread keeps the verifier's GIL busy in short slices, as its engine thread does between CUDA
  calls.
--bare-grpc: no specwire code at all, the floor under it: a bidirectional stream of --bare-bytes byte strings
  that the server echoes, with grpc.aio on the same two loop threads.
--step-socket: the Draft stream over the drafter's step socket (specwire.step_socket) instead of gRPC.
Run it on the machine where the services run: the figures move with its CPU.

    python bench/bench_link_round_trip.py --steps 2000 [--drafter-process] [--busy-thread] \
        [--step-socket] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import grpc
import uvloop

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from specwire.drafter.server import DrafterService  # noqa: E402
from specwire.verifier.drafter_link import DrafterLink  # noqa: E402
from test_services_e2e import Drafter, Loop, tiny_target  # noqa: E402

from specwire import grpc_common  # noqa: E402
from specwire.commands.demo import start, wait_serving
from specwire.commands.demo import stop as stop_services  # noqa: E402
from specwire.default_model import default_model_path  # noqa: E402
from specwire.metrics import VerifierMetrics  # noqa: E402
from specwire.tokenizer import load_tokenizer  # noqa: E402
from specwire.v1 import drafter_pb2 as pb  # noqa: E402
from specwire.weights import load_checkpoint  # noqa: E402
from specwire.wire import PROTOCOL_VERSION  # noqa: E402


class TimedDrafterService(DrafterService):
    """The drafter's servicer, its step timed (the stamps are read after each round trip)."""

    stamps: list[tuple[float, float]] = []

    def run_step(self, *args, **kwargs) -> pb.DraftResult:
        started = time.perf_counter()
        result = super().run_step(*args, **kwargs)
        self.stamps.append((started, time.perf_counter()))
        return result


def busy(done: threading.Event) -> None:
    """Pure-Python work in slices: it holds the GIL whenever it runs, as a thread between torch calls does."""
    while not done.is_set():
        sum(range(2000))
        time.sleep(0)


def bare_grpc(steps: int, warmup: int, size: int) -> list[tuple[float]]:
    """Round trips of an echo stream: grpc.aio server on one loop thread, its client on another."""
    def same(b: bytes) -> bytes:
        return b

    async def echo(requests, context):
        async for message in requests:
            yield message

    async def serve() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo, same, same)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def ping(port: int) -> list[tuple[float]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/bench.Echo/Stream", same, same)()
            out, message = [], b"x" * size
            for _ in range(warmup + steps):
                sent = time.perf_counter()
                await call.write(message)
                await call.read()
                out.append((time.perf_counter() - sent,))
            await call.done_writing()
        return out[warmup:]

    server_loop, client_loop = Loop(), Loop()
    server, port = server_loop.run(serve())
    try:
        return client_loop.run(ping(port), timeout=600)
    finally:
        server_loop.run(server.stop(None))


async def measure(link: DrafterLink, steps: int) -> list[tuple[float, ...]]:
    """Per step, in seconds: (way out, step, way back) with the drafter in this process, else (round trip,)"""
    out = []
    for _ in range(steps):
        sent = time.perf_counter()
        future = link.send(pb.DraftStep(), {})
        result = await link.result(future)
        done = time.perf_counter()
        assert result is not None, "the drafter did not answer"
        if TimedDrafterService.stamps:
            started, ended = TimedDrafterService.stamps.pop()
            out.append((started - sent, ended - started, done - ended))
        else:
            out.append((done - sent,))
    return out


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return {"p50_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * p90,
            "mean_ms": 1e3 * statistics.fmean(ordered)}


def through_specwire(args: argparse.Namespace) -> list[tuple[float, ...]]:
    """Round trips of empty DraftSteps from a DrafterLink to a DrafterService (see the module's text)."""
    tokenizer = load_tokenizer(default_model_path())
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="specwire-link-"))
    socket_path = str(scratch / "drafter.sock") if args.step_socket else None
    if args.drafter_process:
        config = load_checkpoint(default_model_path())[0]
        flags = ["--step-socket", socket_path] if socket_path else []
        service = start("drafter", ["drafter", "--device", "cpu", "--max-drafts", "4", *flags], scratch)
        wait_serving([service], 240)
        port, close_drafter = service.port, lambda: stop_services([service])
    else:
        checkpoint = tiny_target()
        config = checkpoint[0]
        drafter = Drafter(Loop(), checkpoint, tokenizer.fingerprint, service_class=TimedDrafterService,
                          step_socket=socket_path)
        port, close_drafter = drafter.port, drafter.kill
    verifier_loop = Loop()
    link = DrafterLink(f"127.0.0.1:{port}", VerifierMetrics(), step_timeout=5.0, socket_path=socket_path)
    link.handshake = pb.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        tokenizer_fingerprint=tokenizer.fingerprint, num_layers=config.num_layers)

    async def connect() -> None:
        link.start()
        while not link.connected:
            await asyncio.sleep(0.01)

    verifier_loop.run(connect(), timeout=30)
    done = threading.Event()
    worker = threading.Thread(target=busy, args=(done,), daemon=True)
    if args.busy_thread:
        worker.start()
    try:
        verifier_loop.run(measure(link, args.warmup))
        return verifier_loop.run(measure(link, args.steps), timeout=600)
    finally:
        done.set()
        verifier_loop.run(link.close())
        close_drafter()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--busy-thread", action="store_true", help="a GIL-holding thread runs beside the link")
    p.add_argument("--bare-grpc", action="store_true", help="an echo stream in plain grpc.aio, no specwire")
    p.add_argument("--bare-bytes", type=int, default=10_000, help="--bare-grpc message bytes (default 10 kB)")
    p.add_argument("--step-socket", action="store_true",
                   help="the Draft stream over the drafter's Unix step socket instead of gRPC")
    p.add_argument("--drafter-process", action="store_true",
                   help="the drafter in a process of its own (specwire drafter, default model, CPU)")
    p.add_argument("--switch-interval", type=float, default=grpc_common.DEFAULT_SWITCH_INTERVAL,
                   help="sys.setswitchinterval, as the services set it (default %(default)s s)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    rows = bare_grpc(args.steps, args.warmup, args.bare_bytes) if args.bare_grpc else through_specwire(args)
    names = ("way_out", "step", "way_back") if len(rows[0]) == 3 else ("round_trip",)
    parts = dict(zip(names, map(list, zip(*rows, strict=True)), strict=True))
    result = {
        "bench": "link_round_trip", "command": " ".join(sys.argv), "steps": args.steps,
        "bare_grpc": args.bare_grpc, "bare_bytes": args.bare_bytes if args.bare_grpc else None,
        "drafter_process": args.drafter_process,
        "step_socket": args.step_socket,
        "busy_thread": args.busy_thread, "switch_interval_s": args.switch_interval,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "round_trip": summary([sum(r) for r in rows]), **{k: summary(v) for k, v in parts.items()},
    }
    for key in ("round_trip", *(n for n in names if n != "round_trip")):
        s = result[key]
        print(f"{key:>10}: p50 {s['p50_ms']:.3f} ms, p90 {s['p90_ms']:.3f} ms, mean {s['mean_ms']:.3f} ms")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
