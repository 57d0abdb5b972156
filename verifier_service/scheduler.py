"""Continuous batching with speculative verification over TargetEngine.

One asyncio task runs the loop; model work runs on one worker thread so gRPC stays responsive. Each turn:
free what finished or was aborted, prefill waiting requests into free slots, then verify the running
requests and stream their new tokens. Rounds that wait for no drafter answer (target-only, or the drafter
gone) run back to back on the worker, which posts their tokens to the loop to stream and hands back only
when the loop has news (`_wake`: a request came or left, the drafter connected) or a request finished: no
two thread hand-offs a round. Speculation is an add-on that can vanish at any step: proposals are
matched by request id (alignment.py) and a request without one is verified with 0 drafts.

Speculation cache (cache_branches > 0 and a drafter that offers tables): the DraftStep of a round goes out
as soon as its verification is launched. It settles the round before and names the table entry (branch)
being checked now; the drafter answers with a table of drafts for the likeliest outcomes (accepted drafts,
bonus token) of that check, drafted while it runs. When it ends the verifier looks its outcome up: a hit
launches the next verification at once with those drafts (and the q they were drawn from), a miss or a late
table leaves that request without drafts. Such requests get drafts made just in time, before the launch,
when waiting for them pays (just_in_time_wait); the drafter keeps that chain, so the table drafted while it
is checked covers its outcomes and the next round can hit again. The branch is chosen by the realised
outcome only, so the output is exactly the target's. Without tables (serial mode) a round waits for drafts
made for its settled tokens.

Drafter state: `drafter_len` is how many of a request's tokens the drafter has been told. Every step sent
carries each request's tokens (and target features) since then; a new stream resets it to 0, so the next
step re-sends the whole request as NewRequest and the drafter rebuilds its cache.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch
from specwire.kernels.rejection_sampler import SampleOutput, SamplerColumns, prepare_columns, sample_with
from specwire.verifier.alignment import (
    AlignedResult,
    BatchDrafts,
    Drafts,
    ProposalError,
    Table,
    Want,
    batch_drafts,
    read_result,
    read_tables,
)
from specwire.verifier.drafter_link import (
    DrafterLink,
    HandshakeRefused,
    LocalDrafterLink,
    QueuedDrafts,
    TablesAhead,
)
from specwire.verifier.drafting_mode import DEFAULT_EPOCH_ROUNDS, MODES, QUEUED_MODES, DraftingMode
from specwire.verifier.feature_store import FeatureStore, feature_table
from specwire.verifier.request_error import RequestError, in_flight_already

from specwire import round_trace
from specwire.engine import StepOutput, TargetEngine
from specwire.forced_acceptance import rates_tensor
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.staging import Readback, read_back, upload
from specwire.step_profiler import StepProfiler
from specwire.tokenizer import IncrementalDetokenizer, Tokenizer
from specwire.v1 import drafter_pb2 as dpb
from specwire.v1 import generation_pb2 as gpb
from specwire.verification_clock import VerificationClock
from specwire.wire import FEATURE_DTYPES, PROTOCOL_VERSION, TORCH_DTYPE, as_numpy, encode_arrays

log = logging.getLogger("specwire.verifier.scheduler")


def table_wait(verify: float, trip: float | None, since_sent: float, hit_rate: float, tau: float) -> float:
    """Seconds a finished verification waits for its table. A hit is worth its (tau - 1) extra tokens, each
    about a verification's time (a verification of a few tokens costs about a decode step), at the chance
    hit_rate of the table holding the outcome: waiting longer than that loses what the table would save. A
    table due within that budget (its moving-average round trip `trip`, `since_sent` of it gone) is waited
    for, with a quarter of its round trip as margin; one due later is not waited for at all. Before any
    answer came, half the budget."""
    budget = verify * hit_rate * max(tau - 1.0, 0.0)
    if trip is None:
        return 0.5 * budget
    due = trip - since_sent
    return min(max(due, 0.0) + 0.25 * trip, budget) if due <= budget else 0.0


def just_in_time_wait(batch: int, missing: int, tau: float, verify: float) -> float:
    """Seconds a round may wait for drafts made just in time for the `missing` of its `batch` requests that
    have none from a table. They would add about (tau - 1) tokens each to the round, while the wait delays
    every request's tokens, (batch - missing) * tau + missing of them per verification: waiting pays while
    it is shorter than the verification time those extra tokens are worth."""
    tokens = (batch - missing) * tau + missing
    return missing * max(tau - 1.0, 0.0) * verify / tokens


# Request.next_branch of drafts made just in time: the next table is asked for with verifying_chain.
CHAIN = -1


def _cut(d: Drafts, k: int) -> Drafts:
    """The first k of a request's drafts, with their q."""
    return Drafts(d.token_ids[:k], *(None if x is None else x[:k] for x in (d.indices, d.values, d.probs)))


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class Output:
    """New tokens of one request and the text they complete; `finish_reason` set on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str = ""


class OutputSink(Protocol):
    """Where a request's outputs go: an asyncio.Queue its Generate call reads, or a front-end's stream."""

    def put_nowait(self, out: Output, /) -> None: ...


class FeatureRows:
    """A request's target features, one row per token but the last, with amortised O(1) appends. The rows
    are numpy over the tensors' memory (wire.as_numpy): each round appends and slices a few rows per request,
    which numpy does in a microsecond, without torch's dispatch and its release and retake of the GIL."""

    def __init__(self, rows: np.ndarray, dtype: torch.dtype):
        self._data, self.length, self.dtype = rows, rows.shape[0], dtype

    def append(self, rows: np.ndarray) -> None:
        end = self.length + rows.shape[0]
        if end > self._data.shape[0]:
            grown = np.empty((max(end, 2 * self._data.shape[0]), self._data.shape[1]), self._data.dtype)
            grown[:self.length] = self._data[:self.length]
            self._data = grown
        self._data[self.length:end] = rows
        self.length = end

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self._data[:self.length][rows]


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None  # None: its text is made elsewhere (submit's text=False)
    outputs: OutputSink = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)  # prompt + output
    slot: int = -1
    # Where every row of its target features is, for the drafter: on the host (kept while each verification
    # reads its rows back), or in a feature store (written by each forward). Neither: they are lost (the link
    # changed from one to the other while it lived), and it is not drafted.
    features: FeatureRows | None = None
    store: FeatureStore | None = None
    drafter_len: int = 0
    next_drafts: Drafts | None = None  # from the speculation cache: the next verification's drafts
    next_branch: int | None = None  # the table entry they came from, or CHAIN
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    unsent: Output = field(default_factory=lambda: Output([], ""))  # settled, gathering for stream_interval
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: str = ""
    abort: str | None = None  # "abort" (the Abort RPC: the stream ends with ABORT) or "cancel" (client gone)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def live(self) -> bool:
        return self.finish_reason is None and self.abort is None


@dataclass(frozen=True)
class SchedulerConfig:
    num_speculative_tokens: int = 4  # k, drafts asked per request per round
    max_waiting: int = 256
    default_max_tokens: int = 128
    # Sampled drafts are drawn from the top-K of the head's q (and shipped sparse): the drafter's widest, as a
    # wider q accepts more at T = 1 (bench/results/draft_top_k_T1_cpu_session16.json: 1.79 / 1.90 / 1.95 at
    # K = 16 / 32 / 64) for 8 bytes an entry.
    draft_top_k: int = 64
    cache_branches: int = 8  # speculation-cache table entries per request; 0 = serial drafting
    # How long a finished verification waits for a table still on its way; None = decided per round by
    # table_wait() from what a hit is worth and when the table should come. Never longer than the link's
    # step timeout.
    table_wait: float | None = None
    # How long a round waits for drafts made just in time for requests no table had drafts for; None =
    # decided per round by just_in_time_wait() from what they add and how long they took before; 0 = never.
    just_in_time_wait: float | None = None
    # With tables and > 0: epochs of this many rounds drafted serially beside epochs with tables, keeping to
    # the faster (DraftingMode, measured tokens per second; serial wins where tables come late). 0 = tables.
    drafting_epoch: int = 0
    # The modes drafting_epoch chooses from, the first run first. None: all three, but where serial drafts
    # are queued behind the sampler (queue_drafts) serial drafting and none (drafting_mode.QUEUED_MODES).
    drafting_modes: tuple[str, ...] | None = None
    forced_acceptance: tuple[float, ...] | None = None  # benchmarks only: acceptance rate per draft position
    # Benchmarks of synthetic targets only: this share of lookups is made to hit by replacing the settled
    # bonus token with that of an entry for the same number of accepted drafts (the output is then not the
    # target's). Lets a random head show what hits cost and save.
    forced_hit_rate: float | None = None
    # Tokens a stream's chunk gathers before it is sent (a request's first token and its last ones go at
    # once). 1: every round's tokens. More: fewer writes a round, which a co-located verifier's loop makes
    # between verifications (about 33 us each on the H200 host), for a coarser inter-token latency.
    stream_interval: int = 1
    # Seconds a waiting request may wait, while others decode, for more arrivals to share its prefill step
    # (TGI's max_waiting_tokens, in time): a prefill step costs about the same for one prompt or a few (one
    # graph replay or eager forward), and under steady load with speculation requests end, so new ones
    # arrive, one at a time. 0: prefilled at once. Never waits when nothing decodes or when the waiting fill
    # the free slots.
    admit_wait: float = 0.0
    # Serial drafting (and the serial epochs of drafting_epoch): queue the next round's drafts on the
    # drafter's device right behind the sampler (no return to the host in between). None = where the link
    # says so (queues_on_auto) and features live on CUDA.
    queue_drafts: bool | None = None
    # Queued serial drafting, greedy rows, a drafter with branch slots: > 0 asks it for tables ahead of this
    # many branches a request (QueuedDrafts.wants[].num_branches), drafted while each verification runs and
    # looked up on its GPU from the sampler's output, so a round whose every request hit has its drafts
    # before the serial drafting. With forced_hit_rate, the drafter forces its lookups' hits (synthetic).
    queued_tables: int = 0
    # Tables ahead are asked for while hit_rate ** rows is at least this (TablesAhead.worth), and, with an
    # epoch of this many rounds, only while measured faster than serial drafting alone (0: always).
    queued_tables_worth: float = 0.5
    queued_tables_epoch: int = DEFAULT_EPOCH_ROUNDS
    # Drafts read on the device (a drafter process on this host, greedy rows): queue each round's forward
    # right behind the last one's launch, its first tokens and positions taken from that round's sampler on
    # the device, so that the GPU never waits for the host between rounds (Scheduler._launch_ahead).
    launch_ahead: bool = True


@dataclass
class _Step:
    """One verification's results."""

    tokens: list[list[int]]
    features: list[np.ndarray] | None  # per request, its rows of the feature table (wire.as_numpy)
    feature_dtype: torch.dtype | None = None
    queued: list[int] = field(default_factory=list)  # rows whose next drafts were queued behind the sampler
    wants: list[Want] = field(default_factory=list)  # and what was asked for each
    # Requests whose prompts the verification carried: their first tokens and features follow the rows'.
    carried: list[Request] = field(default_factory=list)
    taken: QueuedDrafts | None = None  # the queued drafts, already taken from the link (_launch_ahead)


class _Launch(NamedTuple):
    """A verification queued on the device, to be collected."""

    started: float  # perf_counter() at its launch
    num_drafts: list[int]  # per verified row (carried prompts not included)
    sampled: SampleOutput
    queued: list[int]  # rows whose next drafts are queued behind the sampler
    wants: list[Want]  # and what was asked for each
    carried: list[Request]  # requests whose prompts the forward prefilled
    read_back: bool  # the features went to the host (no store when it was launched), to be picked there
    taken: QueuedDrafts | None = None  # the queued drafts, taken from the link by _launch_ahead
    ahead: _Ahead | None = None  # the next round, its forward launched behind this one's


@dataclass
class _Ahead:
    """The next round's verification, its forward queued right behind this round's launch, before this
    round's tokens reach the host (Scheduler._launch_ahead): this round's rows, each fed the token its sampler
    emitted last and the drafts queued behind it, read on the device. Its sampler and the rest of its launch
    wait for this round's settling, which tells its rows' start positions."""

    rows: list[Request]
    batch: BatchDrafts
    out: StepOutput
    starts: list[int]  # each row's start position: this round's, advanced once its tokens are back
    launch_seconds: float  # the host's time launching its forward


class Scheduler:
    def __init__(self, engine: TargetEngine, tokenizer: Tokenizer, metrics: VerifierMetrics,
                 config: SchedulerConfig = SchedulerConfig(), link: DrafterLink | None = None):
        """engine: built with aux_layers the drafters may ask for (features are the final hidden state, then
        the aux taps); link: the drafter, or None for target-only serving."""
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.config, self.link = config, link
        self.vocab_size, self.max_context = engine.config.vocab_size, engine.max_context
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.draining = False
        self._frees: list[str] = []  # requests the drafter knows that left the batch
        self._in_flight: tuple[asyncio.Future, dict[str, Want]] | None = None  # serial mode's sent step
        self._sitting_out = False  # its rows sat the last round out (_beside_device_drafts)
        self._queued_drafts: QueuedDrafts | None = None  # serial mode's, queued behind the last sampler
        self._ahead: _Ahead | None = None  # the next verification, its forward queued already
        # The sampler's per-request columns on the device, kept while the batch keeps its rows (the very
        # requests, in order) and their draft counts: each round then moves only drafts and positions.
        self._columns: tuple[tuple, SamplerColumns] | None = None
        # Whether serial drafts may be queued behind the sampler where the link can (a remote link can once
        # its drafter maps the features): asked for, or by default where the link says so and features
        # live on a GPU.
        self._queue_asked = config.queue_drafts
        self._verify_seconds = 0.0  # wall time of the last verification, launch to tokens
        # Moving averages for table_wait: the share of on-time tables holding the outcome, and the tokens a
        # verification of drafts settles per request (tau). Their first values make that budget half a
        # verification.
        self._hit_rate, self._tau = 0.5, 2.0
        self._table_sent_at = 0.0
        self._just_in_time_trip: float | None = None  # moving average, send to answer (or to giving up)
        # Requests a "chains" step asked drafts for since the last table step: their table is asked for even
        # when those drafts came late (the drafter kept the chain, or applied the tokens without drafting).
        self._chains_asked: set[str] = set()
        self._drafting = (DraftingMode(config.drafting_epoch, modes=self._drafting_modes())
                          if config.drafting_epoch > 0 else None)
        self._unfinished: deque[tuple] = deque()  # verified rounds whose tokens are not streamed yet
        self._admit_at = 0.0  # when the waiting requests are due for prefill (config.admit_wait)
        # Admitted requests whose prompts the next verification carries (engine.carry_rows): taken by its
        # launch, on whichever thread launches it.
        self._carrying: list[Request] = []
        self._forcing = random.Random(0)  # forced_hit_rate's draws
        self._feature_columns: np.ndarray | slice | None = None
        self._feature_dtype = torch.float32
        self._feature_row_bytes = 0  # one token's features as the drafter takes them
        self._readback = Readback()  # the worker's feature table on its way to the host
        self._tokens_back = Readback()  # the sampler's output, read before the drafts queued behind it
        self._store: FeatureStore | None = None  # instead, for a drafter that takes tensors (co-located)
        # Recorded after each verification the loop launches on CUDA: the loop polls it (see _verify).
        self._verified = torch.cuda.Event() if self.engine.device.type == "cuda" else None
        # Each verification's device time and the device's idle time before it (specwire_verify_gpu_*); a
        # co-located drafter's work runs between verifications, so no idle time is measured beside it.
        self._clock = VerificationClock(self.engine.device, idle=not isinstance(link, LocalDrafterLink))
        # News for the scheduler (a request came or was aborted, the drafter connected, closing): wakes the
        # idle loop, and ends the worker's run of target-only rounds. Cleared at each turn of the loop.
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-engine")
        self._profiler = StepProfiler("verifier")
        round_trace.start("verifier")
        self._task: asyncio.Task | None = None
        if link is not None:
            link.handshake = self.handshake_request()
            link.check_info, link.on_connect = self.check_drafter, self._on_drafter_connect

    # ------------------------------------------------------------------------------------------ requests

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str = "",
               outputs: OutputSink | None = None, text: bool = True) -> Request:
        """Queues a request, or raises RequestError naming what is wrong with it. Its outputs go to `outputs`
        (a front-end process's stream, core_socket.py), else to a queue of its own, `Request.outputs`.
        text=False: its outputs carry token ids only, unless it has stop strings (the front-end makes the
        text of the others)."""
        invalid = gpb.ERROR_CODE_INVALID_ARGUMENT
        if self.draining:
            raise RequestError(gpb.ERROR_CODE_UNAVAILABLE, "the server is shutting down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise in_flight_already(request_id)
        if not prompt:
            raise RequestError(invalid, "prompt is empty")
        if bad := [t for t in prompt if not 0 <= t < self.vocab_size]:
            raise RequestError(invalid, f"prompt token id {bad[0]} out of range [0, {self.vocab_size})")
        try:
            params.validate(self.vocab_size, self.max_context)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop) if text or params.stop else None
        except ValueError as e:
            raise RequestError(invalid, str(e)) from None
        if len(prompt) >= self.max_context:
            raise RequestError(gpb.ERROR_CODE_RESOURCE_EXHAUSTED,
                               f"prompt of {len(prompt)} tokens does not fit the context of "
                               f"{self.max_context} tokens (at most {self.max_context - 1})")
        if len(self.waiting) >= self.config.max_waiting:
            raise RequestError(gpb.ERROR_CODE_RESOURCE_EXHAUSTED,
                               f"the waiting queue is full ({self.config.max_waiting} requests)")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        request = Request(request_id, list(prompt), params, seed, eos, detokenizer, tokens=list(prompt))
        if outputs is not None:
            request.outputs = outputs
        self.requests[request_id] = request
        if not self.waiting:
            self._admit_at = time.perf_counter() + self.config.admit_wait
        self.waiting.append(request)
        self._wake.set()
        return request

    def abort(self, request_id: str, cancelled: bool = False) -> bool:
        """Stops a request; it leaves the batch (and the drafter) at the next step boundary."""
        request = self.requests.get(request_id)
        if request is None or not request.live:
            return False
        request.abort = "cancel" if cancelled else "abort"
        self._wake.set()
        return True

    @property
    def speculating(self) -> bool:
        return self.link is not None and self.link.connected and self.config.num_speculative_tokens > 0

    # ------------------------------------------------------------------------------------------ loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        if self.link is not None:
            self.link.start()

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._wake.set()  # rounds running on the worker end, so that the shutdown does not wait for them
        self._worker.shutdown(wait=True)

    async def _run(self) -> None:
        while True:
            round_trace.mark("v.loop")
            self._wake.clear()
            self._reap()
            self.metrics.num_requests_running.set(len(self.running))
            self.metrics.num_requests_waiting.set(len(self.waiting))
            if not self.running:
                # A round launched ahead whose every row ended is not sampled; its drafts wait, as queued
                # ones do, for the answer that says what became of its requests.
                self._ahead = None
                self._finish_rounds()
            if not self.waiting and not self.running:
                if self._frees and self.speculating:
                    self._send_step([], "serial")
                await self._wake.wait()
                continue
            carried = []
            if self._admit_due():
                carried = self._admit_carried()
                if not carried:
                    self._finish_rounds()
                    await self._guarded(self._prefill, self._admit())
            if self.running:
                group = list(self.running)
                await self._guarded(self._round, group + carried, len(group))

    async def _guarded(self, step, requests: list[Request], *args) -> None:
        """Runs one step; a fault (a kernel error, a bug) fails these requests, never the server."""
        try:
            await step(requests, *args)
        except Exception as e:
            log.exception("step failed", extra={"requests": [r.id for r in requests]})
            for r in requests:
                if r.live:
                    r.finish_reason = "error"
                    r.outputs.put_nowait(Output([], "", "error", f"internal error: {type(e).__name__}: {e}"))

    def _admit_due(self) -> bool:
        """Whether waiting requests are prefilled now: a slot is free and (config.admit_wait) nothing decodes,
        the waiting fill the free slots, or their wait ran out. Read by the worker too: the attributes are
        written whole, under the GIL."""
        # Not while a verification's forward is queued ahead: its rows are the batch (its features go to
        # their slots after this round's settling, and a new request might have one of them by then).
        free = self.engine.num_free_slots
        return self._ahead is None and bool(self.waiting) and free > 0 and (
            not self.running or len(self.waiting) >= free or time.perf_counter() >= self._admit_at)

    def _admit(self) -> list[Request]:
        admitted, budget = [], self.engine.max_prefill_tokens
        while self.waiting and self.engine.num_free_slots and (
                not admitted or len(self.waiting[0].prompt) <= budget):
            r = self.waiting.popleft()
            r.slot = self.engine.allocate_slot()
            budget -= len(r.prompt)
            admitted.append(r)
        self.running += admitted  # they hold slots: reaped like the others, whatever happens
        return admitted

    def _admit_carried(self) -> list[Request]:
        """The waiting requests, admitted, when their prompts can ride the running batch's next verification
        (a prefill forward of their own would read every weight once more and pause every stream): when all
        that the free slots take fit the rows the engine's graphs hold beyond the batch. Else none: a prefill
        step takes many prompts at little more than the price of one (a burst of arrivals), where carrying
        them would take a round each."""
        engine = self.engine
        if not (engine.carry_rows and self.running):
            return []
        due = list(itertools.islice(self.waiting, engine.num_free_slots))
        if not engine.carry_fits([len(r.prompt) for r in due], len(self.running)):
            return []
        for r in due:
            self.waiting.popleft()
            r.slot = engine.allocate_slot()
        return due

    def _reap(self) -> None:
        """Frees requests that finished or were aborted: slot, drafter state, the stream's last message."""
        for r in [r for r in self.waiting if not r.live]:
            self.waiting.remove(r)
            self._release(r)
        for r in [r for r in self.running if not r.live]:
            self.running.remove(r)
            self.engine.free_slot(r.slot)
            if r.drafter_len:
                self._frees.append(r.id)
            self._release(r)

    def _release(self, r: Request) -> None:
        del self.requests[r.id]
        if r.abort is not None and r.finish_reason is None:
            r.finish_reason = "abort"
            r.outputs.put_nowait(Output([], r.detokenizer.flush() if r.detokenizer else "", "abort"))
        reason = r.finish_reason
        self.metrics.requests_finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):
            self.metrics.e2e_request_latency.observe(time.perf_counter() - r.arrived)

    # ------------------------------------------------------------------------------------------ steps

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _prefill(self, admitted: list[Request]) -> None:
        """Prefills requests admitted into self.running and streams their first tokens; where nothing else
        runs, the drafter is told of them at once, so that their first verification has drafts."""
        step = await self._compute(self._prefill_on_worker, admitted)
        for i, (r, tokens) in enumerate(zip(admitted, step.tokens, strict=True)):
            self._prefilled(r, step, i)
            if r.live:  # as in _verify: an abort that came in during the step wins
                self._emit(r, tokens)
        alone = len(self.running) == len(admitted)
        if alone and self.speculating and not self.caching and self._in_flight is None:
            # Told with the step after their first round instead, they were verified once without drafts
            # while the drafter idled (8B shape, batch 1: a 4.7 ms round for one token, then 2.6 ms waiting
            # for the drafter's prefill and drafts; bench/results/session47/). Only where nothing else runs:
            # a running batch has a step out or drafts queued on the drafter, which this one would have to
            # wait behind or beside, and the rounds would then depend on which. A speculation cache's first
            # round drafts just in time, as any round of its does.
            self._in_flight = self._send_step([r for r in admitted if r.live], "serial")

    def _prefilled(self, r: Request, step: _Step, i: int) -> None:
        """r's prompt went through the target (a prefill step, or a verification that carried it, whose
        i-th features are r's): its features are kept for the drafter, its tokens counted."""
        if step.features is not None:
            r.features = FeatureRows(step.features[i], step.feature_dtype)
        else:
            r.store = self._store
        self.metrics.prompt_tokens.inc(len(r.prompt))

    @property
    def caching(self) -> bool:
        """Drafts come from speculation-cache tables (the drafter offers them and they are enabled)."""
        return self.speculating and self.config.cache_branches > 0 and self.link.info.max_branches > 0

    async def _round(self, requests: list[Request], num_running: int) -> None:
        """One verification of the running requests (the first num_running), carrying the prompts of the
        rest (_admit_carried), which join the batch."""
        group, self._carrying = requests[:num_running], requests[num_running:]
        self.running += self._carrying  # they hold slots: reaped like the others, whatever happens
        try:
            await self._verification_round(group)
        finally:
            left, self._carrying = self._carrying, []
        if left:  # no verification was launched (every running request ended first)
            await self._prefill(left)

    async def _verification_round(self, group: list[Request]) -> None:
        """One verification of the whole batch, with its drafts; then the new tokens are settled."""
        live = [r for r in group if r.live]
        round_trace.mark("v.round")
        if not live:
            return
        ahead, self._ahead = self._ahead, None
        if not self.speculating and ahead is None:
            await self._decode(live)
            return
        caching, round_started = self.caching and ahead is None, time.perf_counter()
        mode = self._drafting.mode if self._drafting is not None else "tables"
        tabling = caching and mode == "tables"
        # A serial epoch queues drafts as serial drafting does, but in its last round: whatever mode follows
        # then starts with none queued (an epoch without drafts verifies on the worker, which takes none).
        queueing = not caching or (mode == "serial" and not self._drafting.last_round_of_epoch)
        arriving = None  # queued drafts read on the device, whose answer comes after the launch
        if caching:
            await self._take_drafts_ahead(live)  # a serial epoch's last step, also when "none" follows it
            await self._queued_arrived()  # a serial epoch's, queued behind the last sampler
            live = [r for r in live if r.live]  # the waits may have let aborts in
            drafted = any(r.next_drafts for r in live) or self._queued_drafts is not None
            if live and mode == "none" and not drafted:
                # An epoch without drafts asks the drafter for nothing (the tokens it settles reach it with
                # the next step that is sent, as after any round it was not told of), so its rounds run as
                # target-only decoding runs, back to back on the worker: through the loop, each took 0.4 ms
                # more host time than a target-only step (SmolLM2, H200, bench/results/session30/).
                await self._decode(live, drafting_epoch=True)
                if self._drafting.mode == "serial" and (rest := [r for r in live if r.live]):
                    self._in_flight = self._send_step(rest, "serial")  # the next round's drafts
                return
            if mode != "none":
                await self._draft_just_in_time(live, "serial" if mode == "serial" else "chains")
                live = [r for r in live if r.live]
            if not live:
                return
            batch, sent = self._cached_drafts(live), None
        elif ahead is not None:  # launched with the last round (_launch_ahead): its rows, dead ones too
            live, batch, sent = ahead.rows, ahead.batch, None
            arriving, self._queued_drafts = self._queued_drafts, None  # (taken by its launch)
        else:
            sent, self._in_flight, pending = self._in_flight, None, self._queued_drafts
            batch = self._drafts_on_device(live) if sent is None else None
            if batch is None and sent is None and not any(self._num_drafts(r) for r in live):
                # Every row's last token: no room for drafts, so the verification does not wait for the
                # drafts queued behind the last sampler (their answer is awaited after it). It did: 3.4 ms
                # of a request's 220 (8B shape, batch 1, while the drafter drafted tables; session 47).
                batch, self._queued_drafts = BatchDrafts([[] for _ in live], None), None
            if batch is None:
                live, batch = await self._beside_device_drafts(live, sent)
            round_trace.mark("v.device_drafts")
            arriving = pending if batch is not None else None
            if batch is None:
                result = await self.link.result(sent[0]) if sent else None
                await self._queued_arrived()
                batch = self._drafts_for(live, result, sent[1] if sent else {})
                round_trace.mark("v.drafts")
                live = [r for r in live if r.live]  # the wait may have let aborts in
                if not live:
                    return
        if sent is None:
            self._count_if_down()
        if tabling:  # the tables for this verification's outcomes: the step needs nothing from it, so it goes
            # out first and the drafter has the whole verification to draft them
            self._table_sent_at = time.perf_counter()
            sent = self._send_step(live, "tables", checking=batch.num_drafts)
            await asyncio.sleep(0)  # the link's writer puts it on the wire before this thread launches
        started = time.perf_counter()
        step = await self._verify(live, batch, self._queueable(live, batch) if queueing else [], ahead)
        round_trace.mark("v.verified")
        self._verify_seconds = time.perf_counter() - started
        tables = await self._tables(sent) if caching else None
        try:
            self._settle_round(live, batch.num_drafts, step, caching and mode != "none", tables,
                               sent[1] if caching and sent else {})
        finally:  # whatever happened, the drafter takes no other step before the drafts queued on it
            queued = self._take_queued_drafts(live, step)
        round_trace.mark("v.settled")
        if step.queued and self.link is not None and self.link.tables_ahead.measure is not None:
            # (tables ahead measure their rounds against serial ones; no count where nothing measures)
            self.link.tables_ahead.round_ended(sum(len(t) for t in step.tokens), len(live),
                                               time.perf_counter() - round_started)
        if arriving is not None:  # the answer that came with the drafts read on the device
            await self._queued_arrived(arriving, drafts=False)
            round_trace.mark("v.arrived")
        if self.speculating and not caching:  # carried prompts go to the drafter with the others
            rest = [r for r in [*live, *step.carried] if r.live and r.id not in queued]
            if (rest or self._frees) and self._in_flight is None:  # (else told with the next step)
                self._in_flight = self._send_step(rest, "serial")
            round_trace.mark("v.rest_sent")
        elif caching:
            self._count_round(mode, live, step, time.perf_counter() - round_started)
            if self._drafting is not None and self._drafting.mode == "serial":
                # The next round's drafts, for what this one settled, where not queued on the drafter: as
                # serial drafting's, no chain kept, so that the next round may queue them in turn (a table
                # never checks them: a tables epoch's first round drafts its chains just in time).
                rest = [r for r in live if r.live and r.id not in queued]
                self._in_flight = self._send_step(rest, "serial")

    async def _verify(self, live: list[Request], batch: BatchDrafts, queue: list[int],
                      ahead: _Ahead | None = None) -> _Step:
        """One verification (`ahead`: the one whose forward is queued already), while the last round's
        tokens go out; the next drafts of rows `queue` are queued behind its sampler. On CUDA this thread
        launches and collects it itself: the GPU does the work, and a hand-off to the worker thread and back
        cost about 0.1 ms each of a 1.3-2.8 ms batch-1 round (bench/round_timeline.py). On a CPU the worker
        runs the forward, which would hold the loop for all of it."""
        if self._verified is not None:
            launch = self._launch_verification(live, batch, queue, ahead)
            if launch.queued:  # the tokens are back before the drafts queued behind them are drafted
                verified = self._tokens_back.ready
            else:
                with torch.cuda.device(self.engine.device):
                    self._verified.record()
                verified = self._verified.query
            streamed = self._finish_rounds()
            # Client streams and the drafter's answers are served while the GPU works: the loop polls the
            # device rather than block on it, as the co-located drafter's serial steps leave it no other idle
            # time (blocking, co-located SmolLM2 at batch 16 measured ITL p99 134 ms; polling, 58 ms). And it
            # turns at least once per output it streamed: grpc.aio's poller thread writes a byte to a socket
            # per completed write and the loop reads one a turn, so with fewer turns than writes the bytes
            # pile up until the socket is full, the poller blocks and every stream stalls until the loop
            # idles (co-located SmolLM2 at batch 16: after ~20 chunks, the last ~90 tokens came in one;
            # bench/bench_stream_starvation.py --min-turns shows it on a CPU).
            turns = 0
            await asyncio.sleep(0)
            while not verified() or turns < streamed:
                await asyncio.sleep(0)
                turns += 1
            return self._collect_verification(launch)
        loop = asyncio.get_running_loop()
        launched = loop.create_future()
        verification = loop.run_in_executor(self._worker, self._verify_on_worker, live, batch,
                                            lambda: loop.call_soon_threadsafe(_resolve, launched), queue,
                                            ahead)
        # Until the worker has started the verification, this thread keeps off the GIL it needs for that.
        await asyncio.wait((launched, verification), return_when=asyncio.FIRST_COMPLETED)
        self._finish_rounds()  # the last round's tokens go out while the verification runs
        return await verification

    def _settle_round(self, live: list[Request], num_drafts: list[int], step: _Step, caching: bool = False,
                      tables: dict[str, Table] | None = None, wanted: dict | None = None) -> None:
        """A verification's tokens join their requests, and each asked-for table is looked up. Streaming
        them and the metrics wait in _unfinished for the next verification's launch (or for the loop to have
        nothing to launch): that work then overlaps the GPU instead of delaying it."""
        wanted = wanted or {}
        settled = []
        for i, r in enumerate(live):
            if r.features is not None and step.features is not None:
                r.features.append(step.features[i])
            elif r.features is not None:  # this round's rows went to the store: the host's are not whole now
                r.features = None
            r.next_drafts = r.next_branch = None
            if r.live:  # an abort that came in during the step wins: nothing more is streamed
                if r.id in wanted and tables is not None and self.config.forced_hit_rate is not None:
                    self._force_hit(tables.get(r.id, Table()), step.tokens[i])
                settled.append((r, self._settle(r, step.tokens[i])))
                if r.id in wanted and r.live:
                    self._look_up(r, tables, step.tokens[i])
                elif caching and r.live:
                    self.metrics.cache["unasked"].inc()
        for i in step.queued:  # the drafter took this round's tokens on the device
            live[i].drafter_len = len(live[i].tokens)
        if step.carried:
            for j, r in enumerate(step.carried, start=len(live)):
                self._prefilled(r, step, j)
                if r.live:
                    settled.append((r, self._settle(r, step.tokens[j])))
            self.metrics.prompts_carried.inc(len(step.carried))
        self._unfinished.append((live, num_drafts, step.tokens[:len(live)], settled))

    async def _decode(self, live: list[Request], drafting_epoch: bool = False) -> None:
        """Rounds without drafts, run back to back by the worker (_decode_on_worker)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._worker, self._decode_on_worker, live,
                                   lambda: loop.call_soon_threadsafe(self._finish_rounds), drafting_epoch)

    def _decode_on_worker(self, live: list[Request], on_launch: Callable[[], None], drafting_epoch: bool
                          ) -> None:
        """Verifies `live` without drafts and settles the tokens, round after round until the loop has news
        (_wake), a request finishes or the drafter is back, or (drafting_epoch) the drafting mode's epoch
        without drafts ends. Neither thread waits for the other between two rounds: each launch posts the
        streaming of the rounds before it to the loop (on_launch)."""
        none = BatchDrafts([[] for _ in live], None)
        while True:
            started = time.perf_counter()
            self._count_if_down()
            step = self._verify_on_worker(live, none, on_launch)
            self._settle_round(live, none.num_drafts, step)
            if drafting_epoch:  # the loop waits on this thread meanwhile: the mode is this thread's to update
                self._count_round("none", live, step, time.perf_counter() - started)
            # What this thread reads of the loop's state (flags, lists) is written whole, under the GIL.
            ended = self._drafting.mode != "none" if drafting_epoch else self.speculating
            if self._wake.is_set() or ended or not all(r.live for r in live) or step.carried:
                return
            if self._admit_due():  # an admit_wait ran out
                return

    def _count_round(self, mode: str, live: list[Request], step: _Step, seconds: float) -> None:
        """A speculation-cache round in the metrics, and in the drafting mode's estimate if it has one."""
        tokens = sum(len(t) for t in step.tokens)
        self.metrics.drafting_rounds[mode].inc()
        self.metrics.drafting_seconds[mode].inc(seconds)
        self.metrics.drafting_tokens[mode].inc(tokens)
        if self._drafting is not None:
            self._drafting.record(tokens, len(live), seconds)

    def _count_if_down(self) -> None:
        """A round verified without drafts because the drafter is gone is a fallback."""
        if self.config.num_speculative_tokens and self.link is not None and not self.link.connected:
            self.metrics.fallbacks["down"].inc()

    async def _take_drafts_ahead(self, live: list[Request]) -> None:
        """A serial epoch's drafts: those of the step sent when the last round ended (for the requests whose
        drafts were not queued behind its sampler)."""
        sent, self._in_flight = self._in_flight, None
        if sent is None:
            return
        result = await self.link.result(sent[0])
        # The drafter dropped any table entry of these requests: their chains replace it.
        self._take_chains([r for r in live if r.id in sent[1]], result, sent[1])

    def _take_chains(self, rows: list[Request], result: dpb.DraftResult | None, wants: dict[str, Want]
                     ) -> None:
        """The drafts of a "chains" or "serial" step become these requests' next drafts (None where it had
        none)."""
        drafts = {} if result is None else self._read_drafts(result, wants)
        for r in rows:
            d = drafts.get(r.id)
            found = d is not None and len(d.token_ids) > 0
            r.next_drafts, r.next_branch = (d, CHAIN) if found else (None, None)

    async def _draft_just_in_time(self, live: list[Request], kind: str) -> None:
        """Drafts for the requests the last tables had none for (a miss, a late table, none asked for, a new
        request), when waiting for them pays. kind "chains": the drafter keeps each chain, so the table asked
        for while this round checks it covers its outcomes; "serial" (a serial epoch): it keeps none, and the
        next drafts of these requests may be queued behind this round's sampler."""
        queued = self._queued_drafts.served() if self._queued_drafts is not None else set()
        missing = [r for r in live if r.next_drafts is None and r.id not in queued and self._num_drafts(r)]
        if not missing:
            return
        wait = self.config.just_in_time_wait
        if wait is None:
            wait = just_in_time_wait(len(live), len(missing), self._tau, self._verify_seconds)
            # Asked for only when they should come within half of that: at the full wait they would only
            # break even, and an answer later than the wait costs all of it for nothing.
            if self._just_in_time_trip is not None and self._just_in_time_trip > 0.5 * wait:
                # Forgets a slow spell, slowly: a retry can cost the whole wait, so it comes every ~70 rounds
                # while the trip stays at twice what pays.
                self._just_in_time_trip *= 0.99
                wait = 0.0
        can_draft = kind == "serial" or self.link.info.chains  # a drafter may keep no chains
        sent = self._send_step(missing, kind) if wait > 0 and can_draft else None
        if sent is None:
            self.metrics.just_in_time["declined"].inc(len(missing))
            return
        sent_at = time.perf_counter()
        self._finish_rounds()  # the last round's tokens go out while the drafter drafts
        result = await self.link.result(sent[0], timeout=min(wait, self.link.step_timeout))
        trip = time.perf_counter() - sent_at
        self._just_in_time_trip = trip if self._just_in_time_trip is None else (
            0.8 * self._just_in_time_trip + 0.2 * trip)
        if result is None:
            self.metrics.just_in_time["late"].inc(len(missing))
            return
        self._take_chains(missing, result, sent[1])
        for r in missing:
            self.metrics.just_in_time["undrafted" if r.next_drafts is None else "drafted"].inc()

    def _cached_drafts(self, live: list[Request]) -> BatchDrafts:
        """The drafts the last tables (or a chains or serial step) hold for each request's outcome and those
        queued behind the last sampler, cut to the room each has left."""
        drafts = {}
        for r in live:
            d = r.next_drafts
            if d is None:
                r.next_branch = None
                continue
            drafts[r.id] = _cut(d, self._num_drafts(r))
        return self._with_queued(live, drafts)

    async def _tables(self, sent: tuple[asyncio.Future, dict] | None) -> dict[str, Table] | None:
        """The checked tables of the step sent with this verification, or None if they did not come in time
        (they are then stale: the next step tells the drafter that no branch is checked)."""
        if sent is None:
            return None
        future, wants = sent
        wait = self.config.table_wait
        if wait is None:
            wait = table_wait(self._verify_seconds, self.link.round_trip,
                              time.perf_counter() - self._table_sent_at, self._hit_rate, self._tau)
        result = await self.link.result(future, timeout=min(wait, self.link.step_timeout))
        if result is None:
            return None
        if result.error:
            log.warning("drafter step failed", extra={"error": result.error})
        tables, aligned = read_tables(result, wants, self.vocab_size)
        self._count_bad(aligned)
        self._apply_dropped(result)
        return tables

    def _force_hit(self, table: Table, tokens: list[int]) -> None:
        """forced_hit_rate: rewrites the bonus token (the last of `tokens`) to an entry's, at that rate."""
        accepted = len(tokens) - 1
        if (accepted, tokens[-1]) in table.entries or self._forcing.random() >= self.config.forced_hit_rate:
            return
        if bonuses := [bonus for a, bonus in table.entries if a == accepted]:
            tokens[-1] = self._forcing.choice(bonuses)

    def _look_up(self, r: Request, tables: dict[str, Table] | None, tokens: list[int]) -> None:
        """Picks the table entry for the outcome the sampler just settled: `tokens` are the accepted drafts
        and the bonus token."""
        if tables is None:
            self.metrics.cache["late"].inc()
            return
        try:
            entry = tables.get(r.id, Table()).pick((len(tokens) - 1, tokens[-1]), self.vocab_size)
        except ProposalError as e:  # the picked entry's drafts are bad: this request verifies none
            self._count_bad(AlignedResult(invalid={r.id: str(e)}))
            entry = None
        self.metrics.cache["miss" if entry is None else "hit"].inc()
        self._hit_rate = 0.95 * self._hit_rate + 0.05 * (entry is not None)
        if entry is not None:
            r.next_branch, r.next_drafts = entry

    def _finish_rounds(self) -> int:
        """After verifications: streams their settled tokens, and counts drafts and acceptance. Returns the
        number of outputs streamed."""
        now, streamed = time.perf_counter(), 0
        while self._unfinished:
            live, num_drafts, tokens, settled = self._unfinished.popleft()
            for r, out in settled:
                if r.finish_reason != "abort":  # aborted since it settled: the stream has ended already
                    streamed += self._stream(r, out, now)
            accepted = [len(t) - 1 for t in tokens]
            self.metrics.observe_verification(num_drafts, accepted)
            for r, drafted, taken in zip(live, num_drafts, accepted, strict=True):
                if drafted:
                    self._tau = 0.95 * self._tau + 0.05 * (taken + 1)
                r.drafts += drafted > 0
                r.draft_tokens += drafted
                r.accepted_tokens += taken
        return streamed

    def _drafts_for(self, live: list[Request], result: dpb.DraftResult | None, wants: dict[str, Want]
                    ) -> BatchDrafts:
        """A serial round's drafts: those of the step answered (None: none, as after a timeout or a broken
        stream, which the link counts) and those queued behind the last sampler, cut to each one's room."""
        return self._with_queued(live, {} if result is None else self._read_drafts(result, wants))

    def _with_queued(self, live: list[Request], drafts: dict[str, Drafts]) -> BatchDrafts:
        """`drafts` and those queued behind the last sampler, as the round's batch."""
        queued, self._queued_drafts = self._queued_drafts, None
        if queued is None:
            return batch_drafts([r.id for r in live], drafts, self.vocab_size)
        room = [self._num_drafts(r) for r in live]
        if not drafts and (whole := queued.as_batch([r.id for r in live], room)) is not None:
            # As the drafter left them: the verification is launched without waiting for them, and the
            # sampler reads their q (sampled rows) where it is.
            return BatchDrafts([[0] * k for k in whole.num_drafts.tolist()], whole.probs,
                               whole.token_ids.to(self.engine.device, non_blocking=True))
        split = queued.per_request()
        for r, n in zip(live, room, strict=True):
            if (d := split.get(r.id)) is not None:
                drafts[r.id] = _cut(d, n)
        return batch_drafts([r.id for r in live], drafts, self.vocab_size)

    def _drafts_on_device(self, live: list[Request]) -> BatchDrafts | None:
        """The drafts queued behind the last sampler, read where a drafter process's GPU writes them, before
        its answer comes (QueuedDrafts.device_rows says when); None: they are read from the answer."""
        queued = self._queued_drafts
        if queued is None or queued.on_device is None:  # (the usual case: no list built a round for it)
            return None
        batch = self._read_on_device(queued, [r.id for r in live], [self._num_drafts(r) for r in live])
        if batch is not None:
            self._queued_drafts = None
        return batch

    def _read_on_device(self, queued: QueuedDrafts, request_ids: list[str], room: list[int]
                        ) -> BatchDrafts | None:
        """`queued`'s drafts for a verification of `request_ids` (each cut to its room), read on the device
        behind the drafter's write of them; None where they are not (QueuedDrafts.device_rows)."""
        rows = queued.device_rows(request_ids, room)
        round_trace.mark("v.device_rows")
        if rows is None:
            return None
        self.metrics.drafts_read_on_device.inc()
        self._clock.round_queued()  # the device may idle from here until the drafter's write: "drafts"
        round_trace.mark("v.clock_queued")
        ids = queued.on_device.read(rows, self.vocab_size)
        return BatchDrafts([[0] * k for _, k in rows], None, ids)

    async def _beside_device_drafts(self, live: list[Request], sent: tuple[asyncio.Future, dict] | None
                                    ) -> tuple[list[Request], BatchDrafts | None]:
        """A round with drafts queued behind the last sampler for some of its rows only: the others are new
        to the drafter (their prompts rode the last verification or a prefill step) or were left out, and a
        serial step may be out for them. Rather than make every row wait for the answers, the queued rows read
        their drafts on the device, and the step's rows join them with its answer's drafts once it is in;
        until then they sit the round out (one round at most: the next round waits for the step's answer,
        never for the queued drafts' answer behind it). Rows of neither verify without drafts. Returns the
        round's rows, those read on the device first, and their drafts; or (live, None): every row waits for
        the answers, as when the step asked for sampled drafts (their q would travel beside ids read on the
        device)."""
        queued, (future, wants) = self._queued_drafts, sent or (None, {})
        sat_out, self._sitting_out = self._sitting_out, False
        if queued is None or queued.on_device is None or any(w.temperature > 0 for w in wants.values()):
            return live, None
        result = None
        if future is not None and (future.done() or sat_out):
            # After a round sat out: waiting for every answer made the batch wait for the drafts queued behind
            # the step too, 1.3-2 ms of each arrival (SmolLM2's shape, batch 16, sustained; session 48).
            result = await self.link.result(future)
            live = [r for r in live if r.live]  # the wait may have let aborts in
            future = None
        on_device = {rid: i for i, rid in enumerate(queued.request_ids)}
        reading = sorted((r for r in live if r.id in on_device), key=lambda r: on_device[r.id])
        others = [r for r in live if r.id not in on_device and (future is None or r.id not in wants)]
        ready = self._drafts_on_device(reading) if reading else None
        if ready is None:
            return live, None
        drafts = {} if result is None else self._read_drafts(result, wants)
        if future is not None:
            self._in_flight, self._sitting_out = sent, True
            self.metrics.rows_sat_out.inc(len(live) - len(reading) - len(others))
        joining = [_cut(drafts[r.id], self._num_drafts(r)).token_ids if r.id in drafts else []
                   for r in others]
        ids = ready.on_device
        if any(joining):  # greedy rows: their ids are all the sampler takes of them
            flat = torch.tensor([t for row in joining for t in row], dtype=ids.dtype)
            ids = torch.cat([ids, upload(flat, ids.device)])
        rows = [*ready.token_ids, *([0] * len(row) for row in joining)]
        return reading + others, BatchDrafts(rows, None, ids)

    def _take_queued_drafts(self, live: list[Request], step: _Step) -> set[str]:
        """The drafts queued behind this round's sampler, kept for the next round where the drafter left
        them (not waited for: the next verification is queued behind them); returns the ids of the requests
        they are for. If they are lost, those requests are sent whole next step."""
        if not step.queued:
            return set()
        ids = [live[i].id for i in step.queued]
        counts = [len(step.tokens[i]) for i in step.queued]
        queued = step.taken or self.link.take_drafts(ids, step.wants, counts)
        if queued is None:
            for i in step.queued:
                self._resend_whole(live[i])
            return set()
        self._queued_drafts = queued
        return set(ids)

    async def _queued_arrived(self, queued: QueuedDrafts | None = None, drafts: bool = True) -> None:
        """Waits for the drafts queued behind the last sampler (or `queued`) where they come as an answer (a
        drafter in another process); if it never comes, their requests are sent whole next step, as are
        those the drafter dropped. drafts=False: the answer's drafts are not read (QueuedDrafts.arrive)."""
        queued = queued or self._queued_drafts
        if queued is None:
            return
        await queued.arrive(drafts)
        for rid in queued.request_ids if queued.lost else queued.dropped:
            if (r := self.requests.get(rid)) is not None:  # (a request it dropped is sent whole next step)
                self._resend_whole(r)

    def _queueable(self, live: list[Request], batch: BatchDrafts) -> list[int]:
        """Rows whose next drafts can be queued behind this round's sampler: the drafter drafted their last
        tokens (these drafts) and has been told nothing since."""
        if not (self._queues_serial_drafts() and self.link.can_queue()):
            return []
        return [i for i, (r, k) in enumerate(zip(live, batch.num_drafts, strict=True))
                if k and r.live and r.drafter_len == len(r.tokens) and self._num_drafts(r)]

    def _drafting_modes(self) -> tuple[str, ...]:
        """The modes the adaptive drafting chooses from: the configured ones, else by what this drafter can
        do (a drafter that has not connected yet queues nothing)."""
        if self.config.drafting_modes:
            return self.config.drafting_modes
        return QUEUED_MODES if self.link is not None and self._queues_serial_drafts() else MODES

    def _queues_serial_drafts(self) -> bool:
        """Serial drafts are queued behind the sampler with this drafter: asked for (by default where the
        link says so and features live on a GPU) and the drafter can."""
        device = self.link.feature_device
        asked = self._queue_asked if self._queue_asked is not None else (
            self.link.queues_on_auto and device is not None and device.type == "cuda")
        return bool(asked and self.link.queues_drafts)

    def _read_drafts(self, result: dpb.DraftResult, wants: dict[str, Want]) -> dict[str, Drafts]:
        """The checked drafts of a serial step's answer, per request id; bad ones counted and left out."""
        if result.error:
            log.warning("drafter step failed", extra={"error": result.error})
        aligned = read_result(result, wants, self.vocab_size)
        self._count_bad(aligned)
        self._apply_dropped(result)
        return aligned.drafts

    def _count_bad(self, aligned: AlignedResult) -> None:
        if aligned.unknown_ids:
            self.metrics.bad_payloads.labels(reason="unknown_request").inc(len(aligned.unknown_ids))
        if aligned.invalid:
            self.metrics.bad_payloads.labels(reason="bad_tensor").inc(len(aligned.invalid))
            self.metrics.fallbacks["bad_payload"].inc()
            log.warning("bad drafter proposals", extra={"invalid": aligned.invalid})

    def _resend_whole(self, r: Request) -> None:
        """The drafter holds r in an unknown state: the next step frees it there, then sends it whole."""
        if r.drafter_len:
            self._frees.append(r.id)
        r.drafter_len = 0

    def _apply_dropped(self, result: dpb.DraftResult) -> None:
        for rid in result.dropped_request_ids:  # the drafter lost it: re-send the whole request next step
            if (r := self.requests.get(rid)) is not None:
                r.drafter_len = 0
                r.next_drafts = r.next_branch = None
                if self._queued_drafts is not None:
                    self._queued_drafts.dropped.add(rid)

    def _emit(self, r: Request, new_tokens: list[int]) -> None:
        """Appends tokens up to the first that finishes the request, and streams them."""
        self._stream(r, self._settle(r, new_tokens), time.perf_counter())

    def _settle(self, r: Request, new_tokens: list[int]) -> Output:
        """Appends tokens up to the first that finishes the request (EOS, a stop string, a length limit) and
        returns them with the finish reason. Only a request with stop strings needs their text now, token by
        token, to find the one that stops it; the others are detokenised in _stream, all at once. The Output
        holds all _stream needs: the worker may settle the next round before the loop streams this one."""
        settled, text = [], ""
        for token in new_tokens:
            r.tokens.append(token)
            settled.append(token)
            if r.params.stop:  # such a request always has a detokenizer
                text += r.detokenizer.push([token])
            if token in r.eos_ids or (r.params.stop and r.detokenizer.stopped):
                r.finish_reason = "stop"
            elif r.num_output >= r.params.max_tokens or len(r.tokens) >= self.max_context:
                r.finish_reason = "length"
            if r.finish_reason:
                break
        return Output(settled, text, r.finish_reason)

    def _stream(self, r: Request, out: Output, now: float) -> bool:
        """Streams settled tokens with their text (the rest of it once the request finished), once
        stream_interval of them have gathered; returns whether an output went to a gRPC stream of this
        process (which then needs a turn of the loop: _verify)."""
        text, detokenizer = out.text, r.detokenizer
        if detokenizer is not None and not r.params.stop:
            text += detokenizer.push(out.token_ids)
        if out.finish_reason and detokenizer is not None:
            text += detokenizer.flush()
            if detokenizer.stopped:
                r.matched_stop = self._matched_stop(r)
        self.metrics.generation_tokens.inc(len(out.token_ids))
        r.unsent = Output(r.unsent.token_ids + out.token_ids, r.unsent.text + text, out.finish_reason)
        gathering = len(r.unsent.token_ids) < self.config.stream_interval
        if r.first_token_at and not out.finish_reason and gathering:
            return False
        if r.first_token_at == 0.0:
            r.first_token_at = now
            self.metrics.time_to_first_token.observe(now - r.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - r.last_token_at)
        r.last_token_at = now
        r.outputs.put_nowait(r.unsent)
        r.unsent = Output([], "")
        return isinstance(r.outputs, asyncio.Queue)

    def _matched_stop(self, r: Request) -> str:
        text = self.tokenizer.decode(r.tokens[len(r.prompt):])
        return min((s for s in r.params.stop if s in text), key=text.find, default="")

    # ------------------------------------------------------------------------------------------ worker

    @torch.inference_mode()
    def _prefill_on_worker(self, admitted: list[Request]) -> _Step:
        started = time.perf_counter()
        self._clock.other_work()
        round_trace.mark("v.prefill", sum(len(r.prompt) for r in admitted))
        step = self._prefill_step(admitted)
        round_trace.mark("v.prefilled", len(admitted))
        self.metrics.prefill_step_time.observe(time.perf_counter() - started)
        return step

    def _prefill_step(self, admitted: list[Request]) -> _Step:
        out = self.engine.prefill([(r.slot, r.prompt) for r in admitted])
        graph = self.engine.prefill_graphs is not None
        self.metrics.forward_steps_by_mode["cuda_graph" if graph else "eager"].inc()
        none = BatchDrafts([[] for _ in admitted], None)
        store = self._store  # the loop may replace it meanwhile (a new drafter stream): this step keeps one
        if store is not None:  # before the sampler, whose tokens read back mean the rows are written
            store.write(out.hidden, out.aux_hidden, [r.slot for r in admitted for _ in r.prompt],
                        [i for r in admitted for i in range(len(r.prompt))])
        tokens = self._sample(out.logits, admitted, none).token_lists()
        if self.link is None or store is not None:
            return _Step(tokens, None)
        table = read_back(feature_table(out.hidden, out.aux_hidden))
        rows, first, features = as_numpy(table), 0, []
        for r in admitted:
            features.append(rows[first:first + len(r.prompt)])
            first += len(r.prompt)
        return _Step(tokens, features, table.dtype)

    def _verify_on_worker(self, live: list[Request], batch: BatchDrafts, on_launch=lambda: None,
                          queue: list[int] = (), ahead: _Ahead | None = None) -> _Step:
        """A verification on the worker thread. on_launch: called once the target's forward and the sampler
        are queued on the device (on a CPU, where the forward runs right here, before it, so that the drafter
        works during it). Until then the loop keeps off the GIL, which each of the worker's host-side torch
        calls takes back."""
        queued = self.engine.device.type == "cuda"
        if not queued:
            on_launch()
        launch = self._launch_verification(live, batch, queue, ahead)
        if queued:
            on_launch()
        return self._collect_verification(launch)

    @torch.inference_mode()
    def _launch_verification(self, live: list[Request], batch: BatchDrafts, queue: list[int] = (),
                             ahead: _Ahead | None = None) -> _Launch:
        """Queues the target's forward over each request's last token and drafts (unless `ahead` queued it
        already), the sampler after it, and the next drafts of rows `queue` after that; and, where it may,
        the next round's forward (_launch_ahead)."""
        round_trace.mark("v.verify", len(live))
        if ahead is None:
            started, carry, self._carrying = time.perf_counter(), self._carrying, []
            starts = [len(r.tokens) - 1 for r in live]
            out = self._forward(live, batch, starts, carry)
        else:
            # Its engine-thread time (specwire_verify_step_seconds): the forward's launch and, from here,
            # the rest; not the previous round's settling, which this thread did meanwhile.
            started = time.perf_counter() - ahead.launch_seconds
            carry, starts, out = [], ahead.starts, ahead.out
        sampling = batch if not carry else BatchDrafts(  # a carried prompt's last token: a row without drafts
            [*batch.token_ids, *([] for _ in carry)], batch.probs, batch.on_device)
        # The sampler is queued right behind the forward: the device runs it while the host writes features
        # and tells the drafter (session 40's round marks: that host work outlasted the forward, and the
        # device waited for the sampler's launch).
        sampled = self._sample(out.logits, [*live, *carry], sampling)
        self._clock.verification_ended()
        round_trace.mark("v.sampler_queued")
        # Every fed row's features start towards the drafter now: into the store (rows of rejected drafts are
        # rewritten next round), or to the host, where the settled rows are picked once the sampler has said
        # how many there are. Either way before the tokens' readback: a row goes to a drafter once the host
        # has the tokens that settle it.
        store = self._store  # the loop may replace it meanwhile (a new drafter stream): this launch keeps one
        if store is not None:
            fed = [*zip(live, starts, batch.num_drafts, strict=True),
                   *((r, 0, len(r.prompt) - 1) for r in carry)]  # a prompt: as a row of len - 1 drafts
            store.write(out.hidden, out.aux_hidden, [r.slot for r, _, k in fed for _ in range(k + 1)],
                        [start + j for _, start, k in fed for j in range(k + 1)])
        elif self.link is not None:
            self._readback.start(feature_table(out.hidden, out.aux_hidden))
        round_trace.mark("v.forward_queued")
        queue, wants = list(queue), [self._want_for(live[i], self._num_drafts(live[i])) for i in queue]
        round_trace.mark("v.wants")
        announced = settled = False
        try:
            if queue:  # a drafter's GPU waits for the sampler's output, already queued
                T = self.link.info.max_num_drafts + 1
                cells = [c for i in queue for c in store.cells(live[i].slot, starts[i], T)]
                shape = (len(live) + len(carry), max(sampling.num_drafts, default=0) + 2)  # sampler packed
                announced = self.link.announce_drafts([live[i].id for i in queue], wants, queue, store.flat,
                                                      cells, shape, tables=self._steady(live, queue, carry))
            if announced:  # the tokens come back as soon as the sampler is done, while the drafts are drafted
                self._tokens_back.start(sampled.packed)
                store.ready()
                settled = self.link.settle_drafts(sampled.packed)
        except Exception:
            if announced:  # a drafter waiting for this sampler is released; these requests are re-sent whole
                self.link.drop_drafts()
            raise
        if queue and not settled:  # not announced, or not sent: the drafter holds these in an unknown state
            for i in queue:
                self._resend_whole(live[i])
            queue, wants = [], []
        self.metrics.queued_drafts.inc(len(queue))
        round_trace.mark("v.drafts_queued")
        taken = following = None
        counts = self._ahead_drafts(live, batch.num_drafts, queue, wants, carry) if queue else None
        if counts is not None:
            taken, following = self._launch_ahead(live, wants, counts, sampled.packed, starts)
        return _Launch(started, batch.num_drafts, sampled, queue, wants, carry,
                       self.link is not None and store is None, taken, following)

    def _forward(self, live: list[Request], batch: BatchDrafts, starts: list[int], carry: list[Request],
                 follow: torch.Tensor | None = None) -> StepOutput:
        """Queues the target's forward over each row's last token (or, `follow`: the one that sampler will
        have emitted) and its drafts, starting at `starts`, and over the prompts of `carry`."""
        # Queued behind whatever this verification waits for on the stream (drafts queued behind the last
        # sampler, a drafter's write of them): from here on, the verification's own device time.
        self._clock.verification_began()
        slots = [r.slot for r in live]
        if any(batch.num_drafts) or carry:
            rows = [[0 if follow is not None else r.tokens[-1], *d]
                    for r, d in zip(live, batch.token_ids, strict=True)]
            prompts = [(r.slot, r.prompt) for r in carry]
            out = self.engine.verify(slots, rows, starts, batch.on_device, prompts, follow)
        else:
            out = self.engine.decode(slots, [r.tokens[-1] for r in live], starts)
        round_trace.mark("v.forward_launched")
        self.metrics.forward_steps_by_mode["cuda_graph" if self.engine.step_replayed_graph else "eager"].inc()
        return out

    def _ahead_drafts(self, live: list[Request], num_drafts: list[int], queue: list[int], wants: list[Want],
                      carry: list[Request]) -> list[int] | None:
        """How many drafts each row of the next round verifies if that round is launched now, before this
        one's tokens are back; None: it is not. That is the steady state of a batch whose every row reads its
        queued drafts on the device, and the round must be the one the host would launch once this one is
        settled: the same rows (nothing waits to join, no row sits out, no step is out), greedy. Each row
        verifies the drafts it asked for, cut to its room after the most this round can settle (the host
        would cut them to the room this round leaves: near its end a row verifies fewer drafts launched ahead,
        never other tokens). Without the cut, one row within k + 2 tokens of its end kept its whole batch
        from being launched ahead (SmolLM2 at batch 16: 56% of its rounds launched ahead in static batches,
        20-23% under sustained load; session 48). A row this round may end still does: verified once more
        for nothing, it held its slot a round longer while an arrival waited for it (SmolLM2's shape, batch
        16, sustained: 1.21x / 1.23x -> 1.14x / 1.17x; session 49)."""
        if not (self.config.launch_ahead and self.link.drafts_readable_on_device):
            return None
        if self.waiting or not self._steady(live, queue, carry):
            return None
        counts = []
        for r, k, want in zip(live, num_drafts, wants, strict=True):
            room = self._room(r) - (k + 1)  # its room after the most this round can settle
            if want.temperature > 0 or room < 0:
                return None  # this round may end it
            counts.append(min(want.num_drafts, room))
        return counts

    def _steady(self, live: list[Request], queue: list[int], carry: list[Request]) -> bool:
        """Whether the next round's rows are this one's, all with drafts queued now: nothing rides along or
        could join (a request waits while a slot is free), no step is out, no running request sits this round
        out. Tables ahead are asked for only then: a round whose rows wait for a step's answer while the
        drafter drafts tables waits longer, rows sit out, the batch splits into rounds of one or two, each
        asking for tables again (8B shape, batch 16: 1.35x against 1.80x without them,
        bench/results/session45/)."""
        if carry or self._in_flight is not None or (self.waiting and self.engine.num_free_slots):
            return False
        if len(queue) != len(live) or not all(r.live for r in live):
            return False
        ids = {r.id for r in live}
        return not any(r.live and r.id not in ids for r in self.running)

    def _launch_ahead(self, live: list[Request], wants: list[Want], counts: list[int], packed: torch.Tensor,
                      starts: list[int]) -> tuple[QueuedDrafts, _Ahead | None]:
        """The next round's forward, queued behind this round's sampler and the drafter's write of the drafts
        queued behind that: each row fed the last token the sampler emits (read there, on the device) and
        `counts` of its drafts, read where the drafter writes them. The host launches it before this round's
        tokens are back, so the GPU does not idle while the host settles them and prepares the next launch
        (session 40: 1.3 ms of such host work a round at batch 16, for a 1.4 ms verification). Its sampler is
        launched with the next round, once these tokens are settled. Returns the queued drafts (taken from the
        link) and the round, or None if the drafts are not readable on the device after all."""
        began, ids = time.perf_counter(), [r.id for r in live]
        queued = self.link.take_drafts(ids, wants, [])
        batch = self._read_on_device(queued, ids, counts)
        if batch is None:
            return queued, None
        self.metrics.launched_ahead.inc()
        out = self._forward(live, batch, starts, [], follow=packed)
        return queued, _Ahead(live, batch, out, list(starts), time.perf_counter() - began)

    @torch.inference_mode()
    def _collect_verification(self, launch: _Launch) -> _Step:
        """Waits for a launched verification's tokens and the features of the rows they settle."""
        try:  # the first wait for the device
            tokens = launch.sampled.token_lists(self._tokens_back.wait() if launch.queued else None)
        except Exception:
            if launch.queued:
                self.link.drop_drafts()
            raise
        round_trace.mark("v.tokens")
        if launch.ahead is not None:  # its rows start where these tokens end
            launch.ahead.starts = [s + len(t) for s, t in zip(launch.ahead.starts, tokens, strict=True)]
            self._ahead = launch.ahead
        features = dtype = None
        if launch.read_back:
            # The rows the target ran on whose next token is now settled, as views of the readback buffer:
            # _round copies them into each request's FeatureRows before the next verification reuses it.
            table = self._readback.wait()
            rows, features, first, dtype = as_numpy(table), [], 0, table.dtype
            for drafted, settled in zip(launch.num_drafts, tokens[:len(launch.num_drafts)], strict=True):
                features.append(rows[first:first + len(settled)])
                first += drafted + 1
            for r in launch.carried:  # a carried prompt's rows: every token's
                features.append(rows[first:first + len(r.prompt)])
                first += len(r.prompt)
        self.metrics.verify_step_time.observe(time.perf_counter() - launch.started)
        self.metrics.verified_rows.inc(len(launch.num_drafts))
        for times in self._clock.take():  # this verification's among them: its tokens came after it
            self.metrics.verify_gpu_time.observe(times.verify_seconds)
            for cause, seconds in (("launch", times.launch_seconds), ("drafts", times.drafts_seconds)):
                if seconds is not None:
                    self.metrics.gpu_idle[cause].observe(seconds)
        self._profiler.step()
        round_trace.mark("v.verify_end")
        return _Step(tokens, features, dtype, launch.queued, launch.wants, launch.carried, launch.taken)

    def _sample(self, logits: torch.Tensor, requests: list[Request], batch: BatchDrafts) -> SampleOutput:
        def column(values: list, dtype: type) -> np.ndarray:  # numpy: no torch call per column
            return np.array(values, dtype=dtype)

        # Requests compare by identity, and the key holds them: no other request can match it.
        key = (*requests, *batch.num_drafts)
        if self._columns is None or self._columns[0] != key:
            self._columns = key, prepare_columns(
                column(batch.num_drafts, np.int32),
                column([r.params.temperature for r in requests], np.float32),
                column([r.params.top_k for r in requests], np.int32),
                column([r.params.top_p for r in requests], np.float32),
                column([r.seed for r in requests], np.int64),
                logits.shape[1], logits.device, rates_tensor(self.config.forced_acceptance))
        return sample_with(  # draft ids and q, on the host or a drafter's device: the sampler moves them
            self._columns[1], logits,
            column([t for d in batch.token_ids for t in d], np.int64) if batch.on_device is None
            else batch.on_device,
            batch.probs,
            column([len(r.tokens) for r in requests], np.int64),
            defer_check=True,  # no wait for the device until the one copy back, which also checks
        )

    # ------------------------------------------------------------------------------------------ drafter

    def handshake_request(self) -> dpb.HandshakeRequest:
        c = self.engine.config
        return dpb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            tokenizer_fingerprint=self.tokenizer.fingerprint, num_layers=c.num_layers,
        )

    def check_drafter(self, info: dpb.DrafterInfo) -> None:
        """Picks the feature columns the drafter asked for, or raises HandshakeRefused."""
        H, taps = self.engine.config.hidden_size, self.engine.aux_layers
        if missing := [layer for layer in info.aux_layers if layer not in taps]:
            raise HandshakeRefused(f"drafter wants the input of target layer {missing[0]}, but this verifier "
                                   f"taps layers {list(taps)} (set --aux-layers)")
        blocks = [taps.index(layer) + 1 for layer in info.aux_layers] or [0]
        columns = torch.cat([torch.arange(b * H, (b + 1) * H) for b in blocks])
        if info.feature_dim != len(columns):
            raise HandshakeRefused(f"drafter feature_dim {info.feature_dim} != {len(columns)} "
                                   f"({len(blocks)} x hidden size {H})")
        if info.max_num_drafts < 1:
            raise HandshakeRefused("drafter offers max_num_drafts = 0")
        dtype = TORCH_DTYPE.get(info.feature_dtype)
        if dtype not in FEATURE_DTYPES:  # an unknown enum value has no name: print the number
            raise HandshakeRefused(f"drafter asks for features as DType {info.feature_dtype}; this verifier "
                                   f"sends float32, bfloat16 or float16")
        width = len(columns)
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):  # adjacent blocks: a slice, no gather
            columns = slice(blocks[0] * H, (blocks[-1] + 1) * H)
        else:
            columns = columns.numpy()
        self._feature_columns, self._feature_dtype = columns, dtype
        self._feature_row_bytes = width * dtype.itemsize
        device = self.link.feature_device
        if device is None:
            self._store = None
        elif self._store is None or not self._store.holds(columns, width, dtype, device):
            self._store = FeatureStore(self.engine.max_slots, self.max_context, columns, width, dtype, device,
                                       self.engine.device)
        # else the store of the last stream: live requests' rows are in it, so they can be re-sent whole
        if self._store is not None and self.link.names_rows:
            self.link.share(self._store.flat)

    def _on_drafter_connect(self) -> None:
        """A fresh stream holds nothing: every live request is re-sent whole with its next step."""
        for r in self.running:
            r.drafter_len = 0
        for r in self.running:
            r.next_drafts = r.next_branch = None
        self._frees.clear()
        self._in_flight, self._sitting_out = None, False
        self._queued_drafts = None
        branches = min(self.config.queued_tables, self.link.info.max_branches)
        self.link.tables_ahead = TablesAhead(branches, self.config.forced_hit_rate if branches else None,
                                             self.config.queued_tables_worth, self.config.queued_tables_epoch)
        if self._drafting is not None and (modes := self._drafting_modes()) != self._drafting.modes:
            self._drafting = DraftingMode(self.config.drafting_epoch, modes=modes)
        self._wake.set()

    def _drafter_room(self) -> int:
        """NewRequests the drafter can take now; max_requests 0 means it set no limit."""
        limit = self.link.info.max_requests
        held = sum(r.drafter_len > 0 for r in self.running)
        return max(0, limit - held) if limit else len(self.running)

    def _room(self, r: Request) -> int:
        """Tokens r has room for beside its next one: in its context and in its max_tokens."""
        return min(self.max_context - len(r.tokens), r.params.max_tokens - r.num_output) - 1

    def _num_drafts(self, r: Request) -> int:
        return max(0, min(self.config.num_speculative_tokens, self.link.info.max_num_drafts, self._room(r)))

    def _want_for(self, r: Request, k: int) -> Want:
        p = r.params
        # Seeded requests draft greedily: the sampler verifies one-hot q by the race winner, so their output
        # is the target-only sample whatever the drafts, the batch or the drafter's health.
        temperature = 0.0 if p.greedy or p.seed is not None else p.temperature
        top_k = 0 if temperature == 0 else min(p.top_k or self.config.draft_top_k, self.config.draft_top_k)
        return Want(k, temperature, top_k)

    def _want(self, step: dpb.DraftStep, r: Request, k: int) -> Want:
        """Adds r's DraftWant to `step`."""
        want = self._want_for(r, k)
        message = step.wants.add(request_id=r.id, num_drafts=k, temperature=want.temperature,
                                 top_k=want.top_k)
        if r.params.seed is not None:
            message.seed = r.params.seed
        return want

    @staticmethod
    def _feature_rows(r: Request, start: int) -> tuple[int, int]:
        """The feature rows [first, end) that go with r's tokens from `start` on: the positions before them
        (a whole request, start 0: every token's but the last, which the target has not run on)."""
        return max(start - 1, 0), len(r.tokens) - 1

    def _features(self, sends: list[tuple[Request, int]]
                  ) -> list[dpb.Tensor] | list[torch.Tensor] | list[int]:
        """Per (request, first token to send): the features of the positions before those tokens, picked and
        converted for the drafter (bytes as they are when it takes the dtype the target computes in), views
        of the store for a drafter that takes tensors, or the store's row of the first of them for one that
        maps the store (the link's `names_rows`)."""
        if self._store is not None and self.link.names_rows:
            return [self._store.row(r.slot, self._feature_rows(r, start)[0]) for r, start in sends]
        if self._store is not None:
            self._store.ready()
            return [self._store.view(r.slot, *self._feature_rows(r, start)) for r, start in sends]
        rows = [(r, *self._feature_rows(r, start)) for r, start in sends]
        return encode_arrays([(r.features[first:end][:, self._feature_columns], r.features.dtype)
                              for r, first, end in rows], self._feature_dtype)

    def _send_step(self, group: list[Request], kind: str, checking: list[int] | None = None
                   ) -> tuple[asyncio.Future, dict] | None:
        """Tells the drafter what changed for `group` (and who left), and asks for drafts of `kind`: "serial"
        for the settled tokens, "chains" the same with the chains kept for a table (just in time), or
        "tables" for the outcomes of the verification in flight, which checks checking[i] drafts of
        group[i]. Returns the sent step's future and its wants, or None when nothing was sent or wanted
        (the next step carries these updates)."""
        if not self.link.can_send():
            return None
        step = dpb.DraftStep()
        for rid in self._frees:
            step.updates.add(request_id=rid).free.SetInParent()
        # Past max_requests the drafter refuses a NewRequest, which would then be re-sent whole (every prompt
        # feature) each step. A request without room waits, undrafted, for one; this step's frees come first.
        room = self._drafter_room()
        # A step stays under the link's message limit: a request whose new features (a whole prompt's, or
        # the tokens settled since the drafter last heard of it, many after a stall; 8B shape: 24 KB a token)
        # do not fit waits for a later step once this one is full; one that could never fit is not drafted.
        feature_bytes = self.link.max_step_bytes
        told, sends = [], []  # sends: (request, its first token the drafter has not been told)
        tensors: dict[str, torch.Tensor] = {}  # features handed over as tensors (the store's views)
        for r in group:
            start = r.drafter_len
            if not (r.store is self._store if self._store is not None else r.features is not None):
                continue  # its features are not whole where this stream takes them (the link changed)
            if start < len(r.tokens):
                first, end = self._feature_rows(r, start)
                need = (end - first) * self._feature_row_bytes
                if (start == 0 and room == 0) or need > feature_bytes:
                    continue
                if start == 0:
                    room -= 1
                feature_bytes -= need
                sends.append((r, start))
            told.append(r)
        for (r, start), features in zip(sends, self._features(sends) if sends else [], strict=True):
            update = step.updates.add(request_id=r.id)
            if start == 0:
                update.new_request.token_ids.extend(r.tokens)
            else:
                update.accepted.position = start
                update.accepted.token_ids.extend(r.tokens[start:])
            if isinstance(features, int):
                (update.new_request if start == 0 else update.accepted).shared_row = features
            elif isinstance(features, torch.Tensor):
                tensors[r.id] = features
            else:
                (update.new_request if start == 0 else update.accepted).features.CopyFrom(features)
        wants: dict = {}
        if kind == "tables":
            # A table needs tokens settled since the last one: sent now, or with a "chains" step since.
            fresh = {r.id: start for r, start in sends}
            most = min(self.config.cache_branches, self.link.info.max_branches)
            checked = dict(zip((r.id for r in group), checking, strict=True))
            for r in told:
                chain = r.next_branch == CHAIN
                if (r.id in fresh or r.id in self._chains_asked) and (k := self._num_drafts(r)):
                    want = self._want(step, r, k)
                    message = step.wants[-1]
                    message.num_branches = most
                    if chain:
                        message.verifying_chain = True
                    elif r.next_branch is not None and fresh.get(r.id, 0) > 0:
                        message.verifying_branch = r.next_branch
                    verifying = chain or message.HasField("verifying_branch")
                    wants[r.id] = (want, most, checked[r.id] if verifying else 0)
        else:
            for r in told:
                if k := self._num_drafts(r):
                    wants[r.id] = self._want(step, r, k)
                    step.wants[-1].keep_chain = kind == "chains"
        future = self.link.send(step, tensors)
        if future is None:
            return None
        if kind == "tables":
            self._chains_asked = set()
        elif kind == "chains":
            self._chains_asked.update(wants)
        self._frees.clear()
        for r in told:
            r.drafter_len = len(r.tokens)
        return (future, wants) if wants else None
