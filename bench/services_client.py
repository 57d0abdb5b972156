"""The benchmark's client side: send a batch of streaming Generate requests at once and time every chunk as it
arrives, so throughput and latency are what a gRPC client sees.

Per request: TTFT (request sent to first chunk), the gaps between consecutive chunks (inter-token latency as
vLLM's benchmark defines it: a chunk carries every token a round settled, so with speculation one gap can
bring several tokens) and TPOT ((last chunk - first chunk) / (tokens - 1)).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
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

    @property
    def tpot(self) -> float | None:
        n = len(self.token_ids)
        return (self.seconds - self.ttft) / (n - 1) if n > 1 else None


def read_prompts(path: str | Path, source_prefix: str = "") -> list[str]:
    """Prompts of a JSONL file ({"prompt": ...}; rows with a "source" keep only those starting with
    source_prefix, when one is given)."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if source_prefix and not str(row.get("source", source_prefix)).startswith(source_prefix):
            continue
        prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"no prompts in {path} (source prefix {source_prefix!r})")
    return prompts


def generate(port: int, prompt: str, max_tokens: int, temperature: float, seed: int | None) -> RequestTiming:
    """One chat request with ignore_eos (a fixed length), timed chunk by chunk."""
    sampling = pb.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    request = pb.GenerateRequest(text=prompt, chat=True, sampling=sampling)
    timing = RequestTiming()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = last = time.perf_counter()
        for response in stub.Generate(request, timeout=600):
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
                last = now
            elif kind == "complete":
                timing.drafts = response.complete.usage.drafts
                timing.accepted = response.complete.usage.accepted_tokens
        timing.seconds = last - started
    return timing


def run_batch(port: int, prompts: list[str], max_tokens: int, temperature: float, seed: int | None = None
              ) -> tuple[float, list[RequestTiming]]:
    """(wall seconds, timings) of all prompts sent at once; request i gets seed + i when seeded."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        timings = list(pool.map(
            lambda i: generate(port, prompts[i], max_tokens, temperature, None if seed is None else seed + i),
            range(len(prompts))))
    return time.perf_counter() - started, timings


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
