"""Random traffic against a verifier, with every request accounted for (tests/test_faults.py, bench/soak.py).

Requests arrive at random (Poisson), each a greedy prompt from a fixed list with a random length; some are
cancelled by the client after a random delay, some carry a deadline too short to finish. Each request ends
in exactly one `Outcome`; `problems()` says what was lost, duplicated or wrong against target-only
references (a greedy request's tokens, finished or cut short, are a prefix of the reference).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 600.0
    arrivals_per_second: float = 2.0
    max_in_flight: int = 16
    min_tokens: int = 4
    max_tokens: int = 32
    cancel_fraction: float = 0.15  # the client cancels after a random delay
    deadline_fraction: float = 0.15  # the call's deadline is shorter than the generation needs
    seed: int = 0


@dataclass
class Outcome:
    request_id: str
    prompt_index: int
    max_tokens: int
    planned: str  # "complete", "cancel" or "deadline"
    ended: str = ""  # "complete", "error", "cancelled", "deadline", "rpc_error"
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    completion_tokens: int = -1
    detail: str = ""
    foreign_ids: int = 0  # responses that named another request


async def run_soak(target: str, prompts: list[list[int]], config: SoakConfig) -> list[Outcome]:
    """Drives `config.seconds` of traffic at the verifier `target` (HOST:PORT): one Outcome per request."""
    rng = random.Random(config.seed)
    outcomes: list[Outcome] = []
    slots = asyncio.Semaphore(config.max_in_flight)
    tasks: set[asyncio.Task] = set()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        end = time.monotonic() + config.seconds
        n = 0
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(config.arrivals_per_second))
            await slots.acquire()
            roll = rng.random()
            planned = ("cancel" if roll < config.cancel_fraction else
                       "deadline" if roll < config.cancel_fraction + config.deadline_fraction else "complete")
            outcome = Outcome(f"soak-{config.seed}-{n}", rng.randrange(len(prompts)),
                              rng.randint(config.min_tokens, config.max_tokens), planned)
            n += 1
            outcomes.append(outcome)
            prompt = prompts[outcome.prompt_index]
            task = asyncio.create_task(_one(stub, prompt, outcome, rng.random(), slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return outcomes


async def _one(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], outcome: Outcome, u: float,
               slots: asyncio.Semaphore) -> None:
    request = pb.GenerateRequest(request_id=outcome.request_id, token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=outcome.max_tokens, ignore_eos=True))
    # A deadline from 50 ms up to 1 s: most of these end mid-stream, some before the first token.
    timeout = 0.05 + 0.95 * u if outcome.planned == "deadline" else 600.0
    call = stub.Generate(request, timeout=timeout)
    canceller = None
    if outcome.planned == "cancel":
        canceller = asyncio.get_running_loop().call_later(0.05 + 1.5 * u, call.cancel)
    try:
        async for response in call:
            outcome.foreign_ids += response.request_id != outcome.request_id
            event = response.WhichOneof("event")
            if event == "chunk":
                outcome.token_ids.extend(response.chunk.token_ids)
            elif event == "complete":
                outcome.ended, outcome.finish_reason = "complete", response.complete.finish_reason
                outcome.completion_tokens = response.complete.usage.completion_tokens
            else:
                outcome.ended, outcome.detail = "error", f"{response.error.code}: {response.error.message}"
        if not outcome.ended:
            outcome.ended = "rpc_error"
            outcome.detail = "the stream ended without Complete or Error"
    except asyncio.CancelledError:
        outcome.ended = "cancelled"
    except grpc.aio.AioRpcError as e:
        code = e.code()
        outcome.ended = {grpc.StatusCode.CANCELLED: "cancelled",
                         grpc.StatusCode.DEADLINE_EXCEEDED: "deadline"}.get(code, "rpc_error")
        outcome.detail = f"{code.name}: {e.details()}"
    finally:
        if canceller is not None:
            canceller.cancel()
        slots.release()


def problems(outcomes: list[Outcome], references: list[list[int]]) -> list[str]:
    """What went wrong: a lost or duplicated request or token, an error, output unlike the reference.

    `references[i]` is target-only greedy output of prompt i, at least as long as any request's max_tokens.
    """
    found = []
    ids = [o.request_id for o in outcomes]
    if len(set(ids)) != len(ids):
        found.append("a request id was used twice")
    for o in outcomes:
        where = f"{o.request_id} ({o.planned}, ended {o.ended or 'never'})"
        if o.foreign_ids:
            found.append(f"{where}: {o.foreign_ids} responses named another request")
        if o.ended in ("", "error", "rpc_error"):
            found.append(f"{where}: {o.detail or 'no outcome'}")
        if o.token_ids != references[o.prompt_index][:len(o.token_ids)]:
            found.append(f"{where}: tokens differ from target-only greedy output")
        if len(o.token_ids) > o.max_tokens:
            found.append(f"{where}: {len(o.token_ids)} tokens for max_tokens {o.max_tokens}")
        streamed = len(o.token_ids)
        if o.ended == "complete" and (o.finish_reason != pb.FINISH_REASON_LENGTH
                                      or not o.completion_tokens == streamed == o.max_tokens):
            found.append(f"{where}: finish {o.finish_reason}, usage {o.completion_tokens}, "
                         f"streamed {streamed} of {o.max_tokens}")
    return found


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    """How many requests were planned and how many ended each way, plus streamed tokens."""
    counts: dict[str, int] = {"requests": len(outcomes), "tokens": sum(len(o.token_ids) for o in outcomes)}
    for o in outcomes:
        counts[f"planned_{o.planned}"] = counts.get(f"planned_{o.planned}", 0) + 1
        counts[f"ended_{o.ended or 'never'}"] = counts.get(f"ended_{o.ended or 'never'}", 0) + 1
    return counts
