"""The verifier's connection to the drafter: handshake, one Draft stream, per-step futures, reconnects.

Nothing here can fail a request. A step that is not answered within its deadline resolves to None (the
scheduler decodes that step without drafts) and its late answer is dropped as stale. A broken stream
resolves every waiting step to None, and a background task reconnects with exponential backoff; after
each new stream the scheduler re-sends the state of its live requests (`on_connect`). Any exception while
connecting is logged and retried, so a bug in a check turns speculation off only until it stops raising.
With a step socket (a drafter on this host), the stream runs over it instead of gRPC (specwire.step_socket).
With a drafter on this host that can map GPU memory, the features stay in the verifier's feature table and
the steps name its rows (specwire.shared_features); a drafter that fails to map it gets bytes from then on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from specwire.drafter.proposer import Proposal, drafts_per_request
from specwire.verifier.alignment import Drafts, Want, read_result
from specwire.verifier.drafting_mode import DraftingMode

from specwire import grpc_common, round_trace
from specwire.metrics import VerifierMetrics
from specwire.shared_features import describe, device_uuid, host_id
from specwire.staging import upload
from specwire.step_socket import FrameError, MessageSocket
from specwire.stream_values import RELEASED, HostSlot, SlotWatch, wait_value, write_value
from specwire.v1 import drafter_pb2 as pb
from specwire.v1 import drafter_pb2_grpc

log = logging.getLogger("specwire.verifier.drafter")


class HandshakeRefused(ValueError):
    """The drafter does not fit this verifier (vocabulary, hidden size, tokenizer, features)."""


def _describe(info: pb.DrafterInfo) -> str:
    return f"head {info.head!r}, feature_dim {info.feature_dim}, max_branches {info.max_branches}"


def step_feature_bytes(own_bound: int, drafter_bound: int) -> int:
    """What one step's prompt features may take: 3/4 of the smaller of the two message bounds (the rest is
    room for token ids and wants); drafter_bound 0: the drafter did not say."""
    return min(own_bound, drafter_bound or own_bound) * 3 // 4


_EXPIRED = object()  # a step future's result at its deadline: `result` counts the timeout and returns None


class TablesAhead:
    """Tables ahead for queued greedy steps (--queued-tables): the branches a request and the forced hit rate
    the drafter is told, and whether a step asks for them (`asked`: the last step's branches). Their drafts
    serve a round only where every request of it hit, so a step asks only while that is likely: the running
    hit rate to the power of its rows at least `worth` (0.5: at a hit rate of 0.8, batch 1 to 3 ask; at
    batch 16, 3% of rounds would be served, for the drafter's time drafting tables of 16 x 8 branches).

    Likely is not enough: a table costs the drafter time each round, which a short verification may not
    hide (SmolLM2 with the shipped head on two H200s, batch 1: a hit rate of 0.64, and 1.26x of target-only
    against 1.41x without tables; bench/results/session46/). With `epoch_rounds`, rounds that may ask run in
    epochs with and without tables, measured as DraftingMode measures its modes ("tables" and "serial"), and
    the faster one asks; 0 asks in every such round (a benchmark of the tables themselves)."""

    def __init__(self, branches: int = 0, forced_hit_rate: float | None = None, worth: float = 0.5,
                 epoch_rounds: int = 0):
        self.branches, self.forced_hit_rate, self.worth = branches, forced_hit_rate, worth
        self.hit_rate = 1.0  # per request looked up, a moving average
        self.asked = 0
        self.measure = DraftingMode(epoch_rounds, modes=("tables", "serial")) if branches and epoch_rounds \
            else None
        self._may_ask = (False, False)  # whether the step before the last, and the last, could have asked

    def ask(self, wants: list[Want], steady: bool) -> int:
        """The branches a request a queued step of these wants asks for (0: none); steady: the scheduler's
        word that the round may ask at all."""
        likely = self.hit_rate ** len(wants) >= self.worth
        greedy = not any(w.temperature > 0 for w in wants)
        may = bool(self.branches) and steady and greedy and likely
        self._may_ask = (self._may_ask[1], may)
        chosen = self.measure is None or self.measure.mode == "tables"
        self.asked = self.branches if may and chosen else 0
        return self.asked

    def round_ended(self, tokens: int, requests: int, seconds: float) -> None:
        """A queued round settled `tokens` for `requests` requests in `seconds` (its own time, as
        DraftingMode.record's). With a measure it counts for the current mode where both the step whose
        drafts it verified and the step it queued could have asked (an epoch's first round, not counted,
        covers the step between a change of mode and the first round it shapes)."""
        if self.measure is not None and all(self._may_ask):
            self.measure.record(tokens, requests, seconds)

    def count(self, metrics: VerifierMetrics, rows: int, lookups: int, hits: int, served: bool) -> None:
        """A queued step of `rows` requests with tables ahead: `lookups` of them had a table to look in (on
        the drafter's GPU), `hits` found their outcome there; served: its drafts were the tables'."""
        lookups = min(lookups, rows)
        hits = min(hits, lookups)
        metrics.cache["hit"].inc(hits)
        metrics.cache["miss"].inc(lookups - hits)
        metrics.cache["unasked"].inc(rows - lookups)
        metrics.tables_ahead_served.inc(served)
        if lookups:  # (a request without a table says nothing of the rate)
            kept = 0.95 ** lookups
            self.hit_rate = kept * self.hit_rate + (1 - kept) * hits / lookups


@dataclass
class _Pending:
    future: asyncio.Future
    sent_at: float


class _StepResults:
    """What both links share: a step's future resolves to its DraftResult, None (the drafter is gone) or
    _EXPIRED (its deadline passed; `result` then counts the timeout and returns None)."""

    metrics: VerifierMetrics
    step_timeout: float
    round_trip: float | None = None  # moving average of a step's send-to-answer time, late answers included

    def _answered(self, sent_at: float) -> None:
        seconds = time.perf_counter() - sent_at
        self.metrics.drafter_rpc_latency.observe(seconds)
        self.round_trip = seconds if self.round_trip is None else 0.8 * self.round_trip + 0.2 * seconds

    async def result(self, future: asyncio.Future, timeout: float | None = None) -> pb.DraftResult | None:
        """The step's DraftResult, or None after `timeout` (default step_timeout; a later answer is then
        stale) or when the stream broke. An answer already in costs no wait; else the future itself is
        awaited, a timer resolving it at the deadline: the caller resumes one loop turn after the answer
        (wait_for and shield took three). Only a wait of the whole step timeout counts as a fallback: a
        shorter one is the caller's choice (a table or just-in-time wait), counted by it as late."""
        wait = self.step_timeout if timeout is None else timeout
        if not future.done():
            timer = asyncio.get_running_loop().call_later(wait, self._expire, future)
            try:
                await future
            finally:
                timer.cancel()
        result = future.result()
        if result is _EXPIRED:
            if wait >= self.step_timeout:
                self.metrics.fallbacks["timeout"].inc()
            return None
        if result is None:  # the stream broke while the step was out
            self.metrics.fallbacks["down"].inc()
        return result

    @staticmethod
    def _expire(future: asyncio.Future) -> None:
        if not future.done():
            future.set_result(_EXPIRED)


class LocalDrafterLink(_StepResults):
    """The co-located drafter: the same link for a drafter in this process (one GPU, or a CPU, serves both).
    Steps are the same DraftStep messages, answered by `run_step` in order, without gRPC or serialisation;
    a failed step resolves to None like a broken stream.

    Features cross as tensors on the drafter's device (`feature_device`): the scheduler keeps them there
    (verifier.feature_store) and hands each step views of them, beside the step's messages.

    Steps run on the drafter's own worker thread, except, with `inline`, a step without tables sent while
    the worker is idle: the loop runs it at once. Those are serial drafts, which the loop waits for next
    anyway; a hand-off to the worker and back cost about 0.1 ms each (bench/round_timeline.py). Tables stay
    on the worker, drafted while the loop launches and collects the verification they are for.

    Serial drafts may also skip the step altogether (`announce_drafts`, `settle_drafts`, `take_drafts`):
    queued on the device right behind the sampler of the verification that settles their tokens, they are
    ready when its tokens are read, with no DraftStep built, applied or answered in between."""

    drafts_readable_on_device = False  # (they are this process's, on its drafter's device: `proposal`)

    def __init__(self, run_step: Callable[[pb.DraftStep, dict[str, torch.Tensor]], pb.DraftResult],
                 info: pb.DrafterInfo, mismatch: Callable[[pb.HandshakeRequest], str],
                 metrics: VerifierMetrics, feature_device: torch.device, step_timeout: float = 0.5,
                 max_in_flight: int = 4, inline: bool = False, queue: Callable | None = None,
                 take: Callable | None = None,
                 lookups: Callable[[], tuple[int, int, bool]] = lambda: (0, 0, False)):
        """run_step(step, features): the drafter's step function, given each update's features by request
        id; mismatch: the drafter's handshake check (a one-line reason, or empty); feature_device: where
        the drafter takes features; inline: serial steps may run on the loop (for a GPU drafter, whose step
        is mostly launches and one wait). queue / take: the drafter's queue_drafts and take_drafts
        (DrafterService's, bound to this link's stream), or None; lookups: how many requests of the last
        take had a table ahead to look in (tables_ahead, as DrafterLink's), how many found their outcome
        there, and whether its drafts are the tables'."""
        self._run_step, self._info, self._mismatch, self._inline = run_step, info, mismatch, inline
        self._queue, self._take = queue, take
        self.queues_drafts = queue is not None and take is not None
        self.queues_on_auto = True  # --queue-drafts auto queues where features live on a GPU
        self.tables_ahead = TablesAhead()  # (the scheduler sets it from --queued-tables)
        self.lookups = lookups
        self.names_rows = False  # features are handed over as tensors (views of the store), not named
        self.feature_device = feature_device
        self.max_step_bytes = float("inf")  # features are handed over as tensors, not in the step
        self.metrics, self.step_timeout, self.max_in_flight = metrics, step_timeout, max_in_flight
        self.target = "in-process"
        self.handshake = pb.HandshakeRequest()
        self.check_info: Callable[[pb.DrafterInfo], None] = lambda info: None
        self.on_connect: Callable[[], None] = lambda: None
        self.info: pb.DrafterInfo | None = None
        self.last_error = ""
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-colocated")
        self._announced: tuple | None = None  # announce_drafts' arguments, until settle_drafts
        self._in_flight = 0
        self._next_step = 1

    @property
    def connected(self) -> bool:
        return self.info is not None

    def start(self) -> None:
        """The handshake, as over gRPC: a refusal leaves speculation off with the reason logged."""
        try:
            if problem := self._mismatch(self.handshake):
                raise HandshakeRefused(problem)
            self.check_info(self._info)
        except HandshakeRefused as e:
            self.last_error = str(e)
            log.error("drafter refused: speculation off", extra={"drafter": self.target, "reason": str(e)})
            return
        self.info = self._info
        self.on_connect()

    async def close(self) -> None:
        self.info = None
        self._worker.shutdown(wait=True)

    def can_send(self) -> bool:
        return self.connected and self._in_flight < self.max_in_flight

    def send(self, step: pb.DraftStep, features: dict[str, torch.Tensor]) -> asyncio.Future | None:
        """As DrafterLink.send, with the updates' features as tensors on feature_device."""
        if not self.can_send():
            return None
        step.step_id = self._next_step
        self._next_step += 1
        loop = asyncio.get_running_loop()
        future, sent_at = loop.create_future(), time.perf_counter()
        if self._inline and self._in_flight == 0 and not any(w.num_branches for w in step.wants):
            try:  # the worker is idle, so the drafter's state is this thread's alone
                result, error = self._run_step(step, features), None
            except Exception as e:  # a failed step is a broken stream, as on the worker
                result, error = None, e
            self._answer(future, sent_at, result, error)
            return future
        self._in_flight += 1
        done = loop.run_in_executor(self._worker, self._run_step, step, features)
        done.add_done_callback(lambda task: self._answer_from_worker(task, future, sent_at))
        return future

    def can_queue(self) -> bool:
        """announce_drafts may run now: no step is on the drafter's worker."""
        return self.queues_drafts and self.connected and self._in_flight == 0

    def announce_drafts(self, request_ids: list[str], wants: list[Want], rows: list[int],
                        features: torch.Tensor, feature_cells: list[int], settled_shape: tuple[int, int],
                        tables: bool = True) -> bool:
        """The next drafts of these requests are to be queued behind the sampler about to be launched, whose
        packed output [N, W] = settled_shape settle_drafts then hands over (rows[b]: request b's row;
        features: flat rows on feature_device, feature_cells[b * (max_num_drafts + 1) + j]: the row of the
        feature before request b's j-th settled token). Every request must be held by the drafter with its
        last tokens drafted from. tables: tables ahead may be asked for (TablesAhead decides). In process,
        the drafting is queued by settle_drafts."""
        self._announced = (request_ids, wants, rows, features, feature_cells, tables)
        return True

    def settle_drafts(self, settled: torch.Tensor) -> bool:
        """Queues the announced drafting behind the sampler whose packed output is `settled`. False if the
        drafter refused: it then holds these requests in an unknown state, and they must be re-sent whole."""
        (request_ids, wants, rows, features, feature_cells, tables), self._announced = self._announced, None
        branches = self.tables_ahead.ask(wants, tables)
        try:
            self._queue(request_ids, [w.num_drafts for w in wants], [w.temperature for w in wants],
                        [w.top_k for w in wants], settled, rows, features, feature_cells,
                        [branches] * len(wants) if branches else None, self.tables_ahead.forced_hit_rate)
        except Exception as e:
            self._failed(e)
            return False
        return True

    def take_drafts(self, request_ids: list[str], wants: list[Want], counts: list[int]
                    ) -> QueuedDrafts | None:
        """The drafts settle_drafts queued, once the host has read how many tokens each request settled; their
        ids stay on the drafter's device, not waited for. None when they are lost: these requests must be
        re-sent whole."""
        try:
            proposal = self._take(counts, on_device=True)
        except Exception as e:
            self._failed(e)
            return None
        if self.tables_ahead.asked:
            self.tables_ahead.count(self.metrics, len(wants), *self.lookups())
        return QueuedDrafts(request_ids, wants, proposal)

    def drop_drafts(self) -> None:
        """The verification the queued drafts follow lost its result: the drafter frees their requests
        (the verifier re-sends them whole) and keeps no drafts."""
        if self._announced is not None:  # never queued
            self._announced = None
            return
        try:
            self._take(None)
        except Exception as e:
            self._failed(e)

    def _failed(self, error: BaseException) -> None:
        log.error("co-located drafter failed", extra={"error": repr(error)})
        self.metrics.bad_payloads.labels(reason="link_error").inc()

    def _answer_from_worker(self, task: asyncio.Future, future: asyncio.Future, sent_at: float) -> None:
        self._in_flight -= 1
        error = task.exception()
        self._answer(future, sent_at, None if error is not None else task.result(), error)

    def _answer(self, future: asyncio.Future, sent_at: float, result: pb.DraftResult | None,
                error: BaseException | None) -> None:
        self._answered(sent_at)
        if error is not None:
            self._failed(error)
        if not future.done():
            future.set_result(result)


@dataclass
class DeviceDrafts:
    """A drafter process's queued drafts as its GPU leaves them in this verifier's memory: [n, width] ids
    from the start of `buffer`, there once `slot` holds `sequence`."""

    buffer: torch.Tensor
    slot: HostSlot
    sequence: int
    width: int
    watch: SlotWatch  # ends the GPU's wait after `timeout` seconds (a drafter that stalled or died)
    timeout: float

    def read(self, rows: list[tuple[int, int]], vocab_size: int) -> torch.Tensor:
        """For each (row, k) of `rows`, that row's first k drafts, flat, read by work queued on the current
        stream from now on once the drafter has written them (the host does not wait; past the timeout the
        buffer is read as it is). Ids past the vocabulary (a faulty drafter's) become the last id: drafts
        only decide what is accepted, never what is emitted."""
        wait_value(self.slot, self.sequence, torch.cuda.current_stream(self.buffer.device))
        round_trace.mark("v.value_waited")
        self.watch.watch(self.slot, self.sequence, self.timeout)
        round_trace.mark("v.watched")
        return self.pick(self.buffer, rows, self.width, vocab_size)

    @staticmethod
    def pick(buffer: torch.Tensor, rows: list[tuple[int, int]], width: int, vocab_size: int) -> torch.Tensor:
        """The drafts `read` returns, queued without a wait for the host: the lead rows as a slice where
        they are the buffer's first rows, each read as far (the batch the drafts were queued for), else by
        an index uploaded from the host (rows gone since, or cut to their room)."""
        k = rows[0][1]
        if all(row == i and n == k for i, (row, n) in enumerate(rows)):
            picked = buffer.view(-1)[:len(rows) * width].view(len(rows), width)[:, :k]
        else:
            cells = torch.tensor([row * width + j for row, n in rows for j in range(n)], dtype=torch.int64)
            picked = buffer.view(-1).index_select(0, upload(cells, buffer.device))
        return picked.clamp(0, vocab_size - 1).flatten()


@dataclass
class QueuedDrafts:
    """Drafts queued behind a sampler, as the drafter left them: rows in queue order, ids on its device (an
    in-process drafter's `proposal`), or its answer to come (a drafter in another process: `answer`, awaited
    by `arrive`, then read as a serial step's answer is; where it returns them on the device too,
    `on_device`)."""

    request_ids: list[str]
    wants: list[Want]
    proposal: Proposal | None
    dropped: set[str] = field(default_factory=set)  # requests the drafter has lost since
    answer: Callable[[], Awaitable[pb.DraftResult | None]] | None = None
    vocab_size: int = 0  # of the target, to check an answer's drafts against
    lost: bool = False  # the answer never came: what the drafter holds of these requests is unknown
    on_device: DeviceDrafts | None = None
    _drafts: dict[str, Drafts] = field(default_factory=dict, repr=False)  # the answer's, by request id

    async def arrive(self, drafts: bool = True) -> None:
        """Waits for a remote drafter's answer (nothing to wait for in-process). drafts=False: only what
        became of the requests is read (lost, dropped), not the drafts, which were read on the device."""
        if self.answer is None:
            return
        result = await self.answer()
        self.answer = None
        if result is None:
            self.lost = True
            return
        self.dropped.update(result.dropped_request_ids)
        if not drafts:
            return
        aligned = read_result(result, dict(zip(self.request_ids, self.wants, strict=True)), self.vocab_size)
        self._drafts = aligned.drafts

    def served(self) -> set[str]:
        """The requests these drafts are for, once arrived: none if the answer was lost, and not those the
        drafter dropped."""
        return set() if self.lost else set(self.request_ids) - self.dropped

    def as_batch(self, request_ids: list[str], room: list[int]) -> Proposal | None:
        """The drafts as the drafter left them (ids, and the q of sampled rows, on its device; rows in queue
        order), when they serve a verification of `request_ids` as they are: the same requests in the same
        order, none longer than its room. Else None (per_request then splits them on the host). Greedy rows
        of a batch with sampled ones carry a one-hot q, as batch_drafts gives them."""
        if self.proposal is None or self.dropped or request_ids != self.request_ids:
            return None
        if any(k > n for k, n in zip(self.proposal.num_drafts.tolist(), room, strict=True)):
            return None
        return self.proposal

    def device_rows(self, request_ids: list[str], room: list[int]) -> list[tuple[int, int]] | None:
        """What a verification of `request_ids` reads of on_device before the answer comes: per request, its
        row there and how many drafts (as many as it asked, cut to its room); None: it waits for the answer.
        The requests must be these drafts' in their order, some perhaps gone since (finished), all greedy
        (their drafts carry no q, and a greedy row's output is the target's whatever its drafts are: a
        drafter that refused the step, or dropped a request, costs acceptance only)."""
        if self.on_device is None or self.answer is None:
            return None
        if request_ids == self.request_ids:  # the usual round: the same batch as the drafts were queued for
            rows = list(range(len(request_ids)))
        else:
            at = {rid: i for i, rid in enumerate(self.request_ids)}
            rows = [at.get(rid, -1) for rid in request_ids]
        if not rows or min(rows) < 0 or rows != sorted(rows):  # (a request is in a batch once)
            return None
        wants = [self.wants[row] for row in rows]
        if any(w.temperature > 0 or w.num_drafts > self.on_device.width for w in wants):
            return None
        counts = [min(w.num_drafts, n) for w, n in zip(wants, room, strict=True)]
        return list(zip(rows, counts, strict=True)) if any(counts) else None

    def per_request(self) -> dict[str, Drafts]:
        """The drafts by request id, on the host (this waits for an in-process drafter's)."""
        if self.proposal is None:
            drafts = {} if self.lost else self._drafts
        else:
            drafts = _drafts_by_request(self.request_ids, self.wants, self.proposal)
        return {rid: d for rid, d in drafts.items() if rid not in self.dropped}


def _drafts_by_request(request_ids: list[str], wants: list[Want], proposal: Proposal) -> dict[str, Drafts]:
    """An in-process drafter's drafts per request, each with q of the kind its want asked for. Made in this
    process from the verifier's own features, they are not checked as a message is."""
    out = {}
    temperature, top_k = [w.temperature for w in wants], [w.top_k for w in wants]
    for d in drafts_per_request(proposal, temperature, top_k, torch.int64):
        if d.dense is not None:
            out[request_ids[d.index]] = Drafts(d.token_ids, probs=torch.from_numpy(d.dense))
        elif d.sparse is not None:
            indices, values = map(torch.from_numpy, d.sparse)
            out[request_ids[d.index]] = Drafts(d.token_ids, indices=indices, values=values)
        else:
            out[request_ids[d.index]] = Drafts(d.token_ids)
    return out


class DrafterLink(_StepResults):
    """Sends DraftSteps and hands back their DraftResults, or None when the drafter cannot answer in time.

    A drafter on this host that maps the feature table may also draft behind the sampler (`announce_drafts`,
    `settle_drafts`): the serial step goes out while the target's forward runs, naming the sampler's output
    (copied into a buffer it maps) instead of the tokens, and the drafter's GPU waits until the verifier's
    GPU writes the step's number into a slot of shared host memory after that copy (stream_values). Its
    host work then overlaps the verification instead of following it."""

    def __init__(
        self, target: str, metrics: VerifierMetrics,
        channel_options: grpc_common.ChannelOptions | None = None,
        step_timeout: float = 0.5, max_in_flight: int = 4, backoff: tuple[float, float] = (0.05, 5.0),
        socket_path: str | None = None, share_from: torch.device | None = None,
        drafts_on_device: bool = True,
    ):
        """max_in_flight bounds the steps the drafter holds (answered late or not yet), so a slow drafter is
        never flooded. socket_path: the drafter's step socket, for the Draft stream (the handshake stays on
        gRPC). share_from: the verifier's GPU, whose feature table a drafter on this host may map instead of
        taking bytes. drafts_on_device: such a drafter's queued drafts are also read where its GPU writes
        them into this GPU's memory (QueuedDrafts.on_device), where it can. The owner sets `handshake`,
        `check_info` (raises HandshakeRefused for a drafter it cannot feed) and `on_connect` before
        `start`."""
        self.target, self.metrics, self.socket_path = target, metrics, socket_path
        # None: features travel in the steps, as bytes; else the stream shares the owner's feature table on
        # this device and the steps name its rows (decided at each handshake, before check_info, which
        # hands the table to `share`).
        self.feature_device: torch.device | None = None
        self.share_from, self.drafts_on_device = share_from, drafts_on_device
        self.share_refused = ""  # why a drafter could not map the table: bytes from then on
        self._table: torch.Tensor | None = None  # the owner's feature table [rows, width]
        self._offered = False  # whether this stream's first step offered it
        self._settled: torch.Tensor | None = None  # the sampler outputs settle_drafts shares, int64 [n, 1]
        self._settled_offered = False  # whether this stream has been offered them
        self._slot: HostSlot | None = None  # on GPUs: the verifier's GPU writes each settled step's number
        self._slot_offered = False  # whether this stream has been offered it
        self._sequence = 0  # the number of the last queued step on the slot
        # Where the drafter returns drafts on the device (DrafterInfo.returns_drafts_on_device): its GPU
        # copies each queued step's draft ids into _drafts [n * max_num_drafts] here, then writes the step's
        # number into _drafted (QueuedDrafts.drafts_buffer / drafts_slot).
        self._drafts: torch.Tensor | None = None
        self._retired_drafts: list[torch.Tensor] = []  # outgrown (doubling, so a few), never freed
        self._drafted: HostSlot | None = None
        self._drafted_watch = SlotWatch(lambda: metrics.fallbacks["timeout"].inc())
        self._shape = (0, 0)  # the sampler output's, as announced
        self._announced: tuple[pb.DraftStep, list[str], list[Want]] | None = None  # a CPU's, until settled
        self._queued: tuple[asyncio.Future, list[str], list[Want]] | None = None  # the queued step sent
        # Queued by default over the step socket (serial drafting, SmolLM2 on two H200s: 1.38x-1.40x of
        # target-only at batch 1 against 0.99x-1.08x unqueued, bench/results/session33/); over gRPC, whose
        # writes wait for the loop, only when asked (--queue-drafts on): not measured there
        self.queues_on_auto = socket_path is not None
        self.tables_ahead = TablesAhead()  # (the scheduler sets it from --queued-tables)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0  # the loop's thread (start): settle_drafts on another hands the send to it
        self.channel_options = channel_options or grpc_common.ChannelOptions()
        self.max_step_bytes = step_feature_bytes(self.channel_options.max_message_bytes, 0)
        self.handshake = pb.HandshakeRequest()
        self.check_info: Callable[[pb.DrafterInfo], None] = lambda info: None
        self.step_timeout, self.max_in_flight, self.backoff = step_timeout, max_in_flight, backoff
        self.dead_after = max(5.0, 20 * step_timeout)  # a step unanswered this long: the drafter is hung
        self.info: pb.DrafterInfo | None = None
        self.on_connect: Callable[[], None] = lambda: None
        self._call: grpc.aio.StreamStreamCall | MessageSocket | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()  # steps waiting for the writer of the current stream
        self._writer: asyncio.Task | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_step = 1
        self.epoch = 0  # counts streams opened, so a caller can tell a step went to a stream now gone
        self._task: asyncio.Task | None = None
        self._closed = False
        self.last_error = ""

    @property
    def connected(self) -> bool:
        return self._call is not None

    def start(self) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._task = self._loop.create_task(self._connect_forever())

    async def close(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._close_slot()

    # ------------------------------------------------------------------------------------------ steps

    def can_send(self) -> bool:
        if self._call is None:
            return False
        oldest = min((p.sent_at for p in self._pending.values()), default=time.perf_counter())
        if time.perf_counter() - oldest > self.dead_after:
            self._disconnect(self._call, f"no answer for {self.dead_after:.1f} s")
            return False
        return len(self._pending) < self.max_in_flight

    @property
    def names_rows(self) -> bool:
        """Whether this stream's steps name rows of the shared table (`shared_row`), not carry bytes."""
        return self.feature_device is not None

    @property
    def queues_drafts(self) -> bool:
        """Whether this stream drafts behind the sampler: the drafter maps the table and says it can."""
        return self.names_rows and self.info is not None and self.info.queues_drafts

    def can_queue(self) -> bool:
        return self.queues_drafts and self._queued is None and self.can_send()

    @property
    def _returns_drafts(self) -> bool:
        return self.drafts_on_device and self.info.returns_drafts_on_device

    @property
    def drafts_readable_on_device(self) -> bool:
        """Whether drafts queued now come back where this GPU reads them (take_drafts' `on_device`)."""
        return self._drafted is not None and self._drafts is not None

    def announce_drafts(self, request_ids: list[str], wants: list[Want], rows: list[int],
                        features: torch.Tensor, feature_cells: list[int], settled_shape: tuple[int, int],
                        tables: bool = True) -> bool:
        """As LocalDrafterLink.announce_drafts, for a drafter in another process on this host (called on
        the loop, or on a CPU verifier's worker thread): `features` must be the shared table. On a GPU the
        step goes out now, so the drafter queues its work while the sampler is still being launched; its GPU
        waits for settle_drafts' number in the slot. False when the step could not be sent."""
        if features.data_ptr() != self._table.data_ptr():
            raise ValueError("queued drafts read the shared feature table only")
        n, width = self._shape = settled_shape
        step = pb.DraftStep()
        queued = step.queued
        on_device = self._returns_drafts and features.is_cuda
        if self._settled is None or self._settled.numel() < n * width:
            grown = max(n * width, 2 * (self._settled.numel() if self._settled is not None else 0))
            # zeros: a drafter released without a settle (drop_drafts) reads only tokens a sampler wrote, or 0
            self._settled = torch.zeros(grown, 1, dtype=torch.int64, device=features.device)
            if self._drafts is not None:  # kept: the drafter's GPU may still write into it
                self._retired_drafts.append(self._drafts)
                self._drafts = None
            self._settled_offered = False
        if on_device and self._drafts is None:  # as many rows as the sampler output's buffer
            capacity = self._settled.numel() // width * self.info.max_num_drafts
            self._drafts = torch.zeros(capacity, 1, dtype=torch.int64, device=features.device)
            # DeviceDrafts.read's kernels launched once before any stream waits for the drafter (a kernel's
            # first launch may wait for the device: lazy module loading, bench/results/session38/)
            k = self.info.max_num_drafts
            for picked in ([(0, 1)], [(0, k)], [(0, 1), (0, 1)]):  # a slice, strided or whole; an index
                DeviceDrafts.pick(self._drafts, picked, k, self.handshake.vocab_size)
        if not self._settled_offered:
            queued.settled_buffer.CopyFrom(describe(self._settled))
            if on_device:
                queued.drafts_buffer.CopyFrom(describe(self._drafts))
        if features.is_cuda and not self._slot_offered:  # one a stream: the drafter unlinks it once mapped
            self._new_slot()
            queued.settled_slot = self._slot.path
            if on_device:
                queued.drafts_slot = self._drafted.path
        branches = self.tables_ahead.ask(wants, tables)
        for rid, want in zip(request_ids, wants, strict=True):
            queued.wants.add(request_id=rid, num_drafts=want.num_drafts, temperature=want.temperature,
                             top_k=want.top_k, num_branches=branches)
        if branches and self.tables_ahead.forced_hit_rate is not None:
            queued.forced_hit_rate = self.tables_ahead.forced_hit_rate
        queued.rows.extend(rows)
        queued.feature_cells.extend(feature_cells)
        queued.settled_shape.extend([n, width])
        if self._slot is None:  # a CPU verifier: the step goes once the copy is done (settle_drafts)
            self._announced = (step, request_ids, wants)
            return True
        queued.sequence = self._sequence + 1
        if not self._send_queued(step, request_ids, wants):
            return False
        self._sequence += 1
        return True

    def settle_drafts(self, settled: torch.Tensor) -> bool:
        """The sampler whose output `settled` holds the announced requests' tokens has been queued: its
        output goes into the shared buffer behind it, then the step's number into the slot (on a GPU), or
        the step goes out (on a CPU, where the copy is done when it returns). False when nothing was sent."""
        if tuple(settled.shape) != self._shape:
            raise ValueError(f"the sampler's output is {tuple(settled.shape)}, announced as {self._shape}")
        n, width = self._shape
        self._settled.view(-1)[:n * width].view(n, width).copy_(settled)  # behind the sampler
        if self._slot is not None:
            write_value(self._slot, self._sequence, torch.cuda.current_stream(settled.device))
            return self._queued is not None
        (step, request_ids, wants), self._announced = self._announced, None
        if threading.get_ident() == self._loop_thread:
            return self._send_queued(step, request_ids, wants)
        # a CPU verifier verifies on its worker thread: the loop sends
        sent = asyncio.run_coroutine_threadsafe(self._send_soon(step, request_ids, wants), self._loop)
        return sent.result(5.0)

    def _send_queued(self, step: pb.DraftStep, request_ids: list[str], wants: list[Want]) -> bool:
        future = self.send(step, {})
        if future is None:
            return False
        self._settled_offered = True
        self._slot_offered = self._slot is not None
        self._queued = (future, request_ids, wants)
        return True

    def _new_slot(self) -> None:
        """Fresh slots (for a stream that has not been offered them), numbered from 1."""
        self._close_slot()
        self._slot, self._sequence = HostSlot(), 0
        if self._returns_drafts:
            self._drafted = HostSlot()

    def _close_slot(self) -> None:
        if self._drafted is not None:  # no wait of this GPU for the drafter's number outlives it
            self._drafted.set(RELEASED)
        if self._slot is not None:
            torch.cuda.synchronize(self.feature_device)  # no write into it is left queued
            self._slot.unlink()
            self._slot.close()
            self._slot = None
        if self._drafted is not None:
            self._drafted.unlink()
            self._drafted.close()
            self._drafted = None

    async def _send_soon(self, step: pb.DraftStep, request_ids: list[str], wants: list[Want]) -> bool:
        return self._send_queued(step, request_ids, wants)

    def take_drafts(self, request_ids: list[str], wants: list[Want], counts: list[int]) -> QueuedDrafts:
        """The drafts announce_drafts asked for, to be awaited (QueuedDrafts.arrive) before they are used."""
        (future, ids, asked), self._queued = self._queued, None
        if ids != request_ids:
            raise ValueError("take_drafts for other requests than announce_drafts queued")
        on_device = None
        if self._drafted is not None and self._drafts is not None:
            on_device = DeviceDrafts(self._drafts, self._drafted, self._sequence, self.info.max_num_drafts,
                                     self._drafted_watch, self.step_timeout)
        tabled = len(asked) if self.tables_ahead.asked else 0
        return QueuedDrafts(request_ids, asked, None, answer=lambda: self._queued_answer(future, tabled),
                            vocab_size=self.handshake.vocab_size, on_device=on_device)

    async def _queued_answer(self, future: asyncio.Future, tabled: int) -> pb.DraftResult | None:
        """The answer to a queued step; where it asked `tabled` requests for tables ahead, their lookups are
        counted."""
        result = await self.result(future)
        if result is not None and tabled:
            self.tables_ahead.count(self.metrics, tabled, result.queued_lookups, result.queued_hits,
                                    result.tables_served)
        return result

    def drop_drafts(self) -> None:
        """The verification lost its result: its queued step is left unread (the scheduler re-sends those
        requests whole), and a drafter whose GPU waits for its number is released from the host (it then
        reads an earlier sampler's output, or zeros, and its answer is not read)."""
        self._queued = self._announced = None
        if self._slot is not None:
            self._slot.set(self._sequence)

    def share(self, table: torch.Tensor) -> None:
        """The owner's feature table [rows, width] (a CUDA tensor at the start of its storage, kept alive by
        the owner), offered on the first step of each stream whose steps name its rows."""
        self._table = table

    def send(self, step: pb.DraftStep, features: dict[str, torch.Tensor]) -> asyncio.Future | None:
        """Queues `step` for the stream's writer (its step_id is assigned here) and returns at once; the
        future resolves to its DraftResult, or None (a failed write drops the stream). Returns None, sending
        nothing, when disconnected or when max_in_flight steps are unanswered. `features` must be empty: the
        step carries them, as bytes or as shared rows."""
        if features:
            raise ValueError("a remote drafter's features travel in the step, not as tensors")
        if not self.can_send():
            return None
        if self.names_rows and not self._offered:
            step.shared_features.CopyFrom(describe(self._table))
            self._offered = True
        step.step_id = self._next_step
        self._next_step += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[step.step_id] = _Pending(future, time.perf_counter())
        round_trace.mark("v.send", len(step.wants))
        if isinstance(self._call, MessageSocket) and self._outbox.empty():
            # nothing waits before it: the socket takes it now, not when the loop next runs the writer (a
            # step sent while a verification is being launched would wait for the launch to end)
            self._write_now(self._call, step)
        else:
            self._outbox.put_nowait(step)
        return future

    # ------------------------------------------------------------------------------------------ stream

    async def _connect_forever(self) -> None:
        delay = self.backoff[0]
        while not self._closed:
            channel = grpc_common.create_channel(self.target, self.channel_options)
            started = None
            try:
                started = await self._open(channel)
                await self._read(self._call)  # returns only by raising: the stream broke
            except HandshakeRefused as e:
                if str(e) != self.last_error:
                    log.error("drafter refused: speculation off",
                              extra={"drafter": self.target, "reason": str(e)})
                self.last_error, delay = str(e), self.backoff[1]
            except (grpc.RpcError, OSError) as e:
                message = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                if message != self.last_error:
                    log.warning("drafter unavailable", extra={"drafter": self.target, "reason": message})
                self.last_error = message or type(e).__name__
            except Exception as e:  # a bug in a check or on_connect must not end reconnecting for good
                message = f"{type(e).__name__}: {e}"
                if message != self.last_error:
                    log.error("drafter link error", extra={"drafter": self.target, "error": type(e).__name__,
                                                          "reason": str(e)})
                self.metrics.bad_payloads.labels(reason="link_error").inc()
                self.last_error = message
            finally:
                self._disconnect(self._call, self.last_error)
                await channel.close(None)
            if started is not None and time.perf_counter() - started > 10 * self.backoff[1]:
                delay = self.backoff[0]  # it was up for a good while: retry quickly
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(2 * delay, self.backoff[1])

    async def _open(self, channel: grpc.aio.Channel) -> float:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        response = await stub.Handshake(self.handshake, timeout=5.0, wait_for_ready=False)
        if not response.ok:
            raise HandshakeRefused(response.message or "drafter said no without a reason")
        shares = (self.share_from is not None and not self.share_refused
                  and response.drafter.shared_features_host == host_id()
                  and device_uuid(self.share_from) in response.drafter.shared_features_gpus)
        self.feature_device, self._offered = (self.share_from if shares else None), False
        self._settled_offered = self._slot_offered = False
        self.check_info(response.drafter)
        self.info = response.drafter
        self.max_step_bytes = float("inf") if shares else step_feature_bytes(
            self.channel_options.max_message_bytes, response.drafter.max_message_bytes)
        self.metrics.drafter_features_shared.set(int(shares))
        if self.socket_path is None:
            self._call = call = stub.Draft()
        else:
            self._call = call = await self._open_socket(response.drafter)
        self._outbox = asyncio.Queue()
        self._writer = asyncio.get_running_loop().create_task(self._write(call, self._outbox))
        self.epoch += 1
        self.last_error = ""
        log.info("drafter connected", extra={"drafter": self.target, "head": response.drafter.head,
                                             "step_socket": self.socket_path, "shared_features": shares})
        self.on_connect()
        return time.perf_counter()

    async def _open_socket(self, drafter: pb.DrafterInfo) -> MessageSocket:
        """The step socket's stream, once its first message shows it is the drafter of the handshake."""
        path, max_bytes = self.socket_path, self.channel_options.max_message_bytes
        messages = await MessageSocket.connect(path, pb.DraftResult, max_bytes)
        try:
            info = await asyncio.wait_for(messages.read(pb.DrafterInfo), timeout=5.0)
            if info is None:
                raise OSError(f"step socket {path}: the drafter closed it before saying who it is")
            if info != drafter:
                raise HandshakeRefused(f"step socket {path} belongs to another drafter ({_describe(info)}) "
                                       f"than {self.target} ({_describe(drafter)})")
        except BaseException:
            messages.close()
            raise
        return messages

    async def _write(self, call: grpc.aio.StreamStreamCall | MessageSocket, outbox: asyncio.Queue) -> None:
        """The stream's writer: one write at a time, in order, so that a sender never waits for one."""
        while True:
            step = await outbox.get()
            try:
                round_trace.mark("v.write")
                await call.write(step)
            except (grpc.RpcError, asyncio.InvalidStateError, OSError, FrameError) as e:
                self._disconnect(call, f"write failed: {e}")
                return
            self._written(step)

    def _write_now(self, call: MessageSocket, step: pb.DraftStep) -> None:
        try:
            round_trace.mark("v.write")
            call.write_now(step)
        except (OSError, FrameError) as e:
            self._disconnect(call, f"write failed: {e}")
            return
        self._written(step)

    def _written(self, step: pb.DraftStep) -> None:
        round_trace.mark("v.written")
        self.metrics.rpc_bytes["sent"].inc(step.ByteSize())

    async def _read(self, call: grpc.aio.StreamStreamCall | MessageSocket) -> None:
        while True:
            try:
                result = await call.read()
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # close()
                raise OSError("Draft stream cancelled") from None  # by _disconnect
            if result is grpc.aio.EOF or result is None:  # None: the step socket's end
                raise OSError("drafter closed the Draft stream")
            round_trace.mark("v.answer")
            self.metrics.rpc_bytes["received"].inc(result.ByteSize())
            if result.shared_features_error:  # the steps after it name rows it cannot read: start over
                self.share_refused = result.shared_features_error
                raise OSError(f"the drafter could not map the shared features ({self.share_refused}); "
                              f"features go as bytes from now on")
            pending = self._pending.pop(result.step_id, None)
            if pending is None:
                self.metrics.bad_payloads.labels(reason="unknown_request").inc()
                continue
            self._answered(pending.sent_at)
            if not pending.future.done():  # done: expired at its deadline (the answer is stale), or cancelled
                pending.future.set_result(result)
            self._drop_answered_before(result.step_id)

    def _drop_answered_before(self, step_id: int) -> None:
        """Answers come in order: an earlier step still waiting was skipped by the drafter."""
        for earlier in [s for s in self._pending if s < step_id]:
            pending = self._pending.pop(earlier)
            if not pending.future.done():
                pending.future.set_result(None)

    def _disconnect(self, call: grpc.aio.StreamStreamCall | MessageSocket | None, reason: str) -> None:
        if call is None or call is not self._call:
            return
        call.cancel()
        self._writer.cancel()
        self._call = None
        if self._drafted is not None:  # this GPU waits for no drafts from a stream that is gone
            self._drafted.set(RELEASED)
        self.metrics.drafter_features_shared.set(0)
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_result(None)
        self._pending.clear()
        log.warning("drafter disconnected", extra={"drafter": self.target, "reason": reason})
