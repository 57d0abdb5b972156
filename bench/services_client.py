"""The benchmark's client side: send streaming Generate requests and time every chunk as it arrives, so
throughput and latency are what a gRPC client sees. Two loads: a static batch (all requests at once; the batch
lasts until its slowest request ends) and sustained concurrency (each of N lanes sends its next request as its
last one ends, as a server's users do and as vLLM's benchmark_serving --max-concurrency measures).

Per request: TTFT (request sent to first chunk), the gaps between consecutive chunks (inter-token latency as
vLLM's benchmark defines it: a chunk carries every token a round settled, so with speculation one gap can
bring several tokens) and TPOT ((last chunk - first chunk) / (tokens - 1)). Each process keeps one channel
per port (HTTP/2 streams share it), so TTFT holds no connection set-up.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc


@dataclass
class RequestTiming:
    token_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    seconds: float = 0.0  # request sent to last chunk
    drafts: int = 0
    accepted: int = 0
    sent_at: float = 0.0  # time.perf_counter() when sent (CLOCK_MONOTONIC: comparable across processes)
    arrivals: list[float] = field(default_factory=list)  # seconds after sent_at of each chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried

    @property
    def tpot(self) -> float | None:
        n = len(self.token_ids)
        return (self.seconds - self.ttft) / (n - 1) if n > 1 else None


def read_prompts(path: str | Path, source_prefix: str = "", max_bytes: int = 0) -> list[str]:
    """Prompts of a JSONL file ({"prompt": ...}); rows with a "source" keep only those starting with
    source_prefix when one is given, and prompts longer than max_bytes of UTF-8 are left out (0: none)."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if source_prefix and not str(row.get("source", source_prefix)).startswith(source_prefix):
            continue
        if not max_bytes or len(row["prompt"].encode()) <= max_bytes:
            prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"no prompts in {path} (source prefix {source_prefix!r})")
    return prompts


_channels: dict[int, grpc.Channel] = {}


def _stub(port: int) -> generation_pb2_grpc.GenerationStub:
    """One channel per port and process, opened once: TTFT then holds no connection set-up."""
    if port not in _channels:
        _channels[port] = grpc.insecure_channel(f"127.0.0.1:{port}")
    return generation_pb2_grpc.GenerationStub(_channels[port])


def generate(port: int, prompt: str, max_tokens: int, temperature: float, seed: int | None) -> RequestTiming:
    """One chat request with ignore_eos (a fixed length), timed chunk by chunk."""
    sampling = pb.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    request = pb.GenerateRequest(text=prompt, chat=True, sampling=sampling)
    timing = RequestTiming()
    started = last = timing.sent_at = time.perf_counter()
    for response in _stub(port).Generate(request, timeout=600):
        now = time.perf_counter()
        kind = response.WhichOneof("event")
        if kind == "error":
            raise RuntimeError(f"the verifier refused a request: {response.error.message}")
        if kind == "chunk" and response.chunk.token_ids:
            if timing.token_ids:
                timing.gaps.append(now - last)
            else:
                timing.ttft = now - started
            timing.token_ids += response.chunk.token_ids
            timing.arrivals.append(now - started)
            timing.chunk_tokens.append(len(response.chunk.token_ids))
            last = now
        elif kind == "complete":
            timing.drafts = response.complete.usage.drafts
            timing.accepted = response.complete.usage.accepted_tokens
    timing.seconds = last - started
    return timing


def _run_lanes(port: int, lanes: list[list[tuple[str, int | None]]], max_tokens: int, temperature: float
               ) -> list[list[RequestTiming]]:
    """One thread per lane, each sending its (prompt, seed) requests one after the other."""
    def lane(requests: list[tuple[str, int | None]]) -> list[RequestTiming]:
        return [generate(port, prompt, max_tokens, temperature, seed) for prompt, seed in requests]

    with ThreadPoolExecutor(len(lanes)) as pool:
        return list(pool.map(lane, lanes))


class Client:
    """Sends requests from `processes` worker processes (lanes spread over them, a thread per lane), so that
    Python on the client side is not what limits a large batch; 0 or 1: threads of this process only."""

    def __init__(self, processes: int = 0):
        self.processes = processes
        self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) \
            if processes > 1 else None

    def run_batch(self, port: int, prompts: list[str], max_tokens: int, temperature: float,
                  seed: int | None = None) -> tuple[float, list[RequestTiming]]:
        """(wall seconds, timings in prompt order) of all prompts sent at once; request i gets seed + i."""
        return self.run_sustained(port, prompts, len(prompts), max_tokens, temperature, seed)

    def run_sustained(self, port: int, prompts: list[str], concurrency: int, max_tokens: int,
                      temperature: float, seed: int | None = None) -> tuple[float, list[RequestTiming]]:
        """(wall seconds, timings in prompt order) of the prompts sent `concurrency` at a time: lane j sends
        prompts j, j + concurrency, ... each when the one before has ended; request i gets seed + i."""
        seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        order = [list(range(len(prompts)))[j::concurrency] for j in range(min(concurrency, len(prompts)))]
        lanes = [[(prompts[i], seeds[i]) for i in lane] for lane in order]
        started = time.perf_counter()
        if self._pool is None or len(lanes) == 1:
            got = _run_lanes(port, lanes, max_tokens, temperature)
        else:
            ways = min(self.processes, len(lanes))
            futures = [self._pool.submit(_run_lanes, port, lanes[w::ways], max_tokens, temperature)
                       for w in range(ways)]
            parts = [f.result() for f in futures]
            got = [None] * len(lanes)
            for w, part in enumerate(parts):
                got[w::ways] = part
        wall = time.perf_counter() - started
        timings: list[RequestTiming] = [RequestTiming()] * len(prompts)
        for lane, done in zip(order, got, strict=True):
            for i, timing in zip(lane, done, strict=True):
                timings[i] = timing
        return wall, timings

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def percentiles_ms(values: list[float]) -> dict[str, float] | None:
    """p50 / p90 / p99 (nearest rank) and the mean of seconds, in ms; None without values."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(p: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "mean": 1e3 * statistics.fmean(ordered)}


def summarize(wall: float, timings: list[RequestTiming]) -> dict:
    """Throughput, acceptance and latency percentiles of a set of requests timed over `wall` seconds."""
    tokens = sum(len(t.token_ids) for t in timings)
    drafts, accepted = sum(t.drafts for t in timings), sum(t.accepted for t in timings)
    return {
        "requests": len(timings), "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "ttft_ms": percentiles_ms([t.ttft for t in timings]),
        "itl_ms": percentiles_ms([g for t in timings for g in t.gaps]),
        "tpot_ms": percentiles_ms([t.tpot for t in timings if t.tpot is not None]),
    }
