"""Can a busy event loop starve its own gRPC streams? A model of the co-located verifier at batch 16 without
a model: a real grpc.aio server on uvloop with STREAMS server-streaming calls, each fed by an asyncio.Queue as
`Generate` is fed by its request's outputs, and a "round" coroutine that, per round, holds the loop for BUSY
ms (a co-located round's host work: settling, the drafter's step, the next launch), puts one output in every
queue, then yields for POLL ms (the verification the loop polls for) before the next round. A real client in
another process times every chunk. Reported: how long after its round each output reaches the client (lag),
the gaps between chunks (the services benchmark's ITL) and the lag of each stream's last chunk, with the
handler sending one chunk per output, or with --coalesce every output already waiting in one chunk (as
verifier.server.with_waiting does); --min-turns N makes each round yield at least N loop turns (as the
scheduler's verification wait does, one per output streamed): grpc.aio's poller thread signals each completed
write with a byte on a socket that the loop reads a byte a turn, so fewer turns than writes fill the socket
and stall every stream.

    python bench/bench_stream_starvation.py [--busy-ms 2.0] [--poll-ms 0.8] [--streams 16] [--rounds 55]
        [--coalesce] [--min-turns 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import AsyncIterator

import grpc

METHOD = "/starvation.Bench/Stream"


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def serve(port_out, args: argparse.Namespace) -> None:
    queues: list[asyncio.Queue] = []
    go = asyncio.Event()

    async def stream(request: bytes, context) -> AsyncIterator[bytes]:
        q: asyncio.Queue = asyncio.Queue()
        queues.append(q)
        if len(queues) == args.streams:
            go.set()
        while item := await q.get():  # b"": the last round is out
            parts, end = [item], False
            while args.coalesce and not q.empty():  # every output already waiting, in one chunk
                more = q.get_nowait()
                if not more:
                    end = True
                    break
                parts.append(more)
            yield b",".join(parts)
            if end:
                return

    async def rounds() -> None:
        await go.wait()
        for _ in range(args.rounds):
            spin(args.busy_ms / 1e3)
            stamp = str(time.time()).encode()
            for q in queues:
                q.put_nowait(stamp)
            poll_end, turns = time.perf_counter() + args.poll_ms / 1e3, 0
            await asyncio.sleep(0)
            while time.perf_counter() < poll_end or turns < args.min_turns:
                await asyncio.sleep(0)
                turns += 1
        for q in queues:
            q.put_nowait(b"")

    handler = grpc.unary_stream_rpc_method_handler(stream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "starvation.Bench", {"Stream": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_out.put(port)
    await rounds()
    await asyncio.sleep(1.0)
    await server.stop(None)


def run_server(port_out, args: argparse.Namespace) -> None:
    import uvloop
    uvloop.run(serve(port_out, args))


async def client(port: int, streams: int) -> list[list[tuple[float, list[float]]]]:
    """Per stream: (arrival time, the round stamps in the chunk) of each chunk."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD)

        async def one() -> list[tuple[float, list[float]]]:
            chunks = []
            async for message in call(b""):
                chunks.append((time.time(), [float(s) for s in message.split(b",")]))
            return chunks

        return await asyncio.gather(*(one() for _ in range(streams)))


def measure(args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=run_server, args=(ports, args))
    server.start()
    port = ports.get(timeout=30)
    streams = asyncio.run(client(port, args.streams))
    server.join(timeout=30)
    lags = [arrival - stamp for chunks in streams for arrival, stamps in chunks for stamp in stamps]
    gaps = [b[0] - a[0] for chunks in streams for a, b in zip(chunks, chunks[1:], strict=False)]
    last_lag = [chunks[-1][0] - chunks[-1][1][-1] for chunks in streams]

    def pct(values: list[float], p: float) -> float:
        values = sorted(values)
        return 1e3 * values[min(len(values) - 1, int(p * len(values)))]

    return {
        "coalesce": args.coalesce, "min_turns": args.min_turns,
        "busy_ms": args.busy_ms, "poll_ms": args.poll_ms, "streams": args.streams,
        "rounds": args.rounds, "chunks_per_stream": statistics.mean(len(c) for c in streams),
        "lag_ms": {"p50": pct(lags, 0.5), "p99": pct(lags, 0.99), "max": pct(lags, 1.0)},
        "gap_ms": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99)},
        "last_chunk_lag_ms_mean": 1e3 * statistics.mean(last_lag),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy-ms", type=float, default=2.0)
    p.add_argument("--poll-ms", type=float, default=0.8)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=55)
    p.add_argument("--coalesce", action="store_true")
    p.add_argument("--min-turns", type=int, default=0, help="loop turns a round yields at least")
    print(json.dumps(measure(p.parse_args())))


if __name__ == "__main__":
    main()
