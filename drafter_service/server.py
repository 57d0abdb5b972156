"""The Drafter gRPC service: hosts an EagleProposer and answers each DraftStep of a verifier's stream.

Per step: apply the updates in order (new / accepted / free), then draft for the wanted requests and answer
with one DraftResult: draft ids plus the exact float32 q they were drawn from (none for greedy drafts,
top-K sparse for truncated sampling, dense for untruncated). An update that cannot be applied (bad tensor,
unknown request, a position that skips tokens) drops that request and names it in dropped_request_ids,
so the verifier re-sends it whole. State belongs to the stream: when it ends, its requests are freed.
A stream comes over gRPC (`Draft`) or, from a verifier on this host, over the step socket (`serve_socket`).
A verifier on this host may also share its feature table in GPU memory (specwire.shared_features): the
stream's updates then name rows of it instead of carrying feature bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import grpc
import numpy as np
import torch
from specwire.drafter.proposer import (
    VERIFYING_CHAIN,
    EagleProposer,
    Proposal,
    ProposerError,
    drafts_per_request,
)
from specwire.kernels import table_lookup

from specwire import round_trace
from specwire.config import ModelConfig
from specwire.grpc_common import DEFAULT_MAX_MESSAGE_BYTES
from specwire.metrics import DrafterMetrics
from specwire.shared_features import host_id, open_table, shared_rows, unreadable_rows, visible_gpus
from specwire.step_profiler import StepProfiler
from specwire.step_socket import FrameError, MessageSocket
from specwire.stream_values import RELEASED, HostSlot, wait_value, write_value
from specwire.v1 import drafter_pb2 as pb
from specwire.v1 import drafter_pb2_grpc
from specwire.wire import (
    FEATURE_DTYPES,
    PROTOCOL_VERSION,
    WIRE_DTYPE,
    WireError,
    decode_tensor,
    encode_arrays,
    encode_tensor,
)

log = logging.getLogger("specwire.drafter")


class _StepReader:
    """A Draft stream's DraftSteps until it ends or the server drains. Each read is awaited directly (racing
    every read against the drain in a task of its own costs two tasks and two loop turns a step); one watcher
    per stream cancels the read in progress when the drain starts."""

    def __init__(self, read: Callable[[], Awaitable[object]], draining: asyncio.Event):
        """read: the stream's next message, grpc.aio.EOF or None at its end."""
        self.read, self.draining = read, draining
        self._reader = asyncio.current_task()
        self._reading = self._cancelled = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        await self.draining.wait()
        if self._reading:
            self._cancelled = True
            self._reader.cancel()

    async def next(self) -> pb.DraftStep | None:
        """The next DraftStep, or None at the end of the stream or once the server drains."""
        if self.draining.is_set():
            return None
        self._reading = True
        try:
            step = await self.read()
        except asyncio.CancelledError:
            if not self._cancelled:
                raise  # the client went away, or the server is stopping
            self._reader.uncancel()
            return None
        finally:
            self._reading = False
        return None if step is grpc.aio.EOF else step  # the socket's end is None already

    def close(self) -> None:
        self._watcher.cancel()


class SettleTimeout(WireError):
    """A queued step's number never came: the verifier stalled or died mid-verification (a link fault)."""


class _SharedOutput:
    """A stream's shared sampler output (flat int64, in the verifier's memory) and, on GPUs, the slot the
    verifier's GPU writes each queued step's number into once that output is there; where the verifier
    reads the drafts on its GPU, the buffer they go into (also its memory) and the slot this GPU writes the
    step's number into behind them."""

    def __init__(self, buffer: torch.Tensor, slot: HostSlot | None):
        self.buffer, self.slot, self.sequence = buffer, slot, 0
        self.drafts: torch.Tensor | None = None
        self.drafted: HostSlot | None = None

    @staticmethod
    def _map_slot(path: str) -> HostSlot:
        try:
            slot = HostSlot(path)
        except (ValueError, OSError, RuntimeError) as e:
            raise WireError(f"queued drafts: cannot map the verifier's slot: {e}") from e
        slot.unlink()  # mapped by both processes now: nothing is left behind if either dies
        return slot

    def open_slot(self, path: str, device: torch.device) -> None:
        slot = self._map_slot(path)
        self.close(device)  # (a verifier's second slot on one stream replaces the first)
        self.slot, self.sequence = slot, 0

    def open_drafted(self, path: str, device: torch.device) -> None:
        slot = self._map_slot(path)
        self._close_drafted(device)  # (a verifier's second slot on one stream replaces the first)
        self.drafted = slot

    def _drafts_cells(self, rows: int, width: int) -> torch.Tensor:
        """The verifier's buffer's first rows x width cells, [rows, width]; refused if it is smaller."""
        if rows * width > self.drafts.numel():
            raise WireError(f"queued drafts: {rows} x {width} drafts do not fit the verifier's buffer of "
                            f"{self.drafts.numel()}")
        return self.drafts.view(-1)[:rows * width].view(rows, width)

    def return_drafts(self, drafts: torch.Tensor, sequence: int) -> None:
        """Queues on this GPU, behind the drafting: drafts [n, width] into the verifier's buffer, then
        `sequence` into its slot."""
        self._drafts_cells(*drafts.shape).copy_(drafts, non_blocking=True)
        write_value(self.drafted, sequence, torch.cuda.current_stream(drafts.device))

    def publish_to(self, rows: int, width: int, sequence: int) -> table_lookup.Publish:
        """Where a lookup of tables ahead that hit for every request puts the step's drafts ([rows, width]
        into the verifier's buffer, as return_drafts does) and its number."""
        cells = self._drafts_cells(rows, width).view(-1)
        return table_lookup.Publish(cells, table_lookup.Address(self.drafted.address), sequence)

    def release_drafted(self, sequence: int) -> None:
        """From the host: the verifier's GPU reads whatever the buffer holds (a refused step)."""
        if self.drafted is not None and self.drafted.value < sequence:
            self.drafted.set(sequence)

    def await_number(self, sequence: int, timeout: float) -> None:
        """Waits on the host until the verifier's GPU has written `sequence` (its sampler's output is in
        the buffer); past `timeout` seconds this GPU's wait is released and the step is refused."""
        deadline = time.monotonic() + timeout
        while self.slot.value < sequence:
            if time.monotonic() > deadline:
                self.slot.set(sequence)
                raise SettleTimeout(f"queued drafts: the verifier's sampler did not settle step {sequence} "
                                    f"in {timeout:g} s")
            time.sleep(20e-6)

    def close(self, device: torch.device) -> None:
        """Lets go of the slots (the stream ended, or another replaces it): no wait of either GPU outlives
        them, and no write of this one is left queued into them."""
        self._close_drafted(device)
        if self.slot is not None:
            self._let_go(self.slot, device)
            self.slot = None

    def _close_drafted(self, device: torch.device) -> None:
        if self.drafted is not None:
            self._let_go(self.drafted, device)
            self.drafted = None

    @staticmethod
    def _let_go(slot: HostSlot, device: torch.device) -> None:
        slot.set(RELEASED)
        if device.type == "cuda":  # (a CPU drafter may hold a slot it refused: nothing waits on it)
            torch.cuda.synchronize(device)
        slot.close()


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, metrics: DrafterMetrics, draining: asyncio.Event | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, shared_features: bool = True):
        """Refuses handshakes until `load`. draining: set when the server drains; open Draft streams then
        end, so verifiers fall back at once instead of waiting out the grace period. max_message_bytes:
        the step socket's bound (gRPC's is the server's), told to verifiers in the handshake.
        shared_features: offer to map a verifier's feature table (a drafter on a GPU only)."""
        self.metrics, self.draining = metrics, draining or asyncio.Event()
        self.max_message_bytes, self.shared_features = max_message_bytes, shared_features
        self.proposer: EagleProposer | None = None
        self._streams = itertools.count()
        self._known: dict[str, int] = {}  # proposer key -> tokens the drafter holds for it
        self._tables: dict[int, torch.Tensor] = {}  # stream -> the verifier's shared feature table, mapped
        self._settled: dict[int, _SharedOutput] = {}  # stream -> the verifier's shared sampler output
        self.settle_timeout = 10.0  # seconds a queued step waits for the verifier's sampler, then is dropped
        self._queued: list[str] = []  # keys of queue_drafts, until take_drafts
        self._queue_seconds = 0.0
        self._tables_refused = False  # whether a step asked for tables ahead this drafter cannot draft
        self._profiler = StepProfiler("drafter")
        round_trace.start("drafter")

    def load(self, proposer: EagleProposer, target: ModelConfig, tokenizer_fingerprint: str, head_name: str
             ) -> None:
        self.target, self.fingerprint = target, tokenizer_fingerprint
        head = proposer.head.config
        self.info = pb.DrafterInfo(
            head=head_name, feature_dim=head.feature_dim,
            aux_layers=list(head.aux_layers) if head.arch == "eagle3" else [],
            max_num_drafts=proposer.max_drafts, max_requests=proposer.max_requests,
            max_branches=proposer.max_branches, chains=proposer.max_branches > 0,
            feature_dtype=WIRE_DTYPE[proposer.head.dtype], max_message_bytes=self.max_message_bytes,
        )
        if self.shared_features and proposer.device.type == "cuda":
            self.info.shared_features_host = host_id()
            self.info.shared_features_gpus.extend(visible_gpus())
            self.info.queues_drafts = self.info.returns_drafts_on_device = True
        self.proposer = proposer

    # ------------------------------------------------------------------------------------------ RPCs

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HandshakeResponse:
        if self.proposer is None:
            return pb.HandshakeResponse(ok=False, message="the drafter is still loading",
                                        protocol_version=PROTOCOL_VERSION)
        problem = self.mismatch(request)
        if problem:
            log.warning("handshake refused", extra={"reason": problem})
        return pb.HandshakeResponse(ok=not problem, message=problem, drafter=self.info,
                                    protocol_version=PROTOCOL_VERSION)

    def mismatch(self, r: pb.HandshakeRequest) -> str:
        """One line naming the first thing the verifier and this drafter disagree on; empty if none."""
        t, mine = self.target, "the drafter's target"
        checks = [
            (r.protocol_version == PROTOCOL_VERSION,
             f"protocol version {r.protocol_version} != {PROTOCOL_VERSION}"),
            (r.vocab_size == t.vocab_size, f"vocab_size {r.vocab_size} != {mine} {t.vocab_size}"),
            (r.hidden_size == t.hidden_size, f"hidden_size {r.hidden_size} != {mine} {t.hidden_size}"),
            (r.num_layers in (0, t.num_layers), f"num_layers {r.num_layers} != {mine} {t.num_layers}"),
            (r.tokenizer_fingerprint == self.fingerprint,
             f"tokenizer fingerprint {r.tokenizer_fingerprint[:12]}... != {mine} {self.fingerprint[:12]}..."),
            (r.feature_dim in (0, self.info.feature_dim),
             f"feature_dim {r.feature_dim} != the head's {self.info.feature_dim}"),
        ]
        return next((message for ok, message in checks if not ok), "")

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if self.proposer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading")
        await self._serve_stream(context.read, context.write, context.peer())

    async def serve_socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A Draft stream from the step socket (specwire.step_socket): this drafter's DrafterInfo first, then
        the same steps as over gRPC. A verifier connects only after its gRPC handshake, so one that comes
        while loading or draining is turned away."""
        messages = MessageSocket(reader, writer, pb.DraftStep, self.max_message_bytes)
        try:
            if self.proposer is not None and not self.draining.is_set():
                await messages.write(self.info)
                await self._serve_stream(messages.read, messages.write, "step socket")
        except (FrameError, OSError) as e:  # garbage or a reset: this stream ends, the drafter serves on
            self.metrics.bad_payloads.labels(reason="link_error").inc()
            log.warning("step socket stream ended", extra={"reason": str(e) or type(e).__name__})
        finally:
            messages.close()

    async def _serve_stream(self, read: Callable[[], Awaitable[object]],
                            write: Callable[[pb.DraftResult], Awaitable[None]], peer: str) -> None:
        stream = next(self._streams)
        owned: set[str] = set()
        loop = asyncio.get_running_loop()
        log.info("draft stream opened", extra={"stream": stream, "peer": peer})
        # Steps are drafted on this thread (the proposer is single-threaded; the GPU does the work, and a
        # hand-off to a worker thread and back cost about 0.1 ms each of a 1-3 ms round: round_trace), and
        # what came meanwhile is read whenever this task waits. When several wait, the older ones only apply
        # their updates and answer without drafts: their tables would come after the verifications they were
        # for had ended, and drafting them would make every later table late too.
        inbox: asyncio.Queue = asyncio.Queue(maxsize=64)
        reader = loop.create_task(self._read_steps(read, inbox))
        try:
            while (step := await inbox.get()) is not None:
                if isinstance(step, BaseException):
                    raise step  # the read failed (an undecodable message, the client gone): as if read here
                # else a newer step (or the stream's end) is waiting; queued drafts are never stale: they are
                # for the verification running as they were sent
                fresh = inbox.empty() or step.HasField("queued")
                self.metrics.rpc_bytes["received"].inc(step.ByteSize())
                round_trace.mark("d.taken")
                refused = self._map(stream, step.shared_features) if step.HasField("shared_features") else ""
                features = self._gather(step, self._tables.get(stream))
                round_trace.mark("d.gathered")
                result = self.run_step(stream, owned, step, features, draft=fresh)
                result.shared_features_error = refused
                round_trace.mark("d.returned")
                self.metrics.rpc_bytes["sent"].inc(result.ByteSize())
                await write(result)
                round_trace.mark("d.written")
        finally:
            # Freed before any await: a stream cancelled again while it waits for its reader (a connection
            # reset under load) would otherwise keep its requests held for good (the link-fault test: 8 left).
            self._free_all(owned)
            self._tables.pop(stream, None)
            if (shared := self._settled.pop(stream, None)) is not None:
                shared.close(self.proposer.device)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            log.info("draft stream closed", extra={"stream": stream})

    async def _read_steps(self, read: Callable[[], Awaitable[object]], inbox: asyncio.Queue) -> None:
        """Moves the stream's steps into `inbox`, then None at its end or the error that ended the reads
        (a full inbox holds the reads back). The reader lives in this task, so a drain ends its read here."""
        steps = _StepReader(read, self.draining)
        try:
            while (step := await steps.next()) is not None:
                round_trace.mark("d.read", len(step.wants))
                await inbox.put(step)
        except Exception as e:
            await inbox.put(e)
            return
        finally:
            steps.close()
        await inbox.put(None)

    # ------------------------------------------------------------------------------------------ worker

    def _map(self, stream: int, offer: pb.SharedFeatures) -> str:
        """Maps the offered table for the stream's later steps; or says why not (the verifier then
        reconnects and sends bytes)."""
        self._tables.pop(stream, None)
        try:
            if not self.info.shared_features_host:
                raise WireError("shared features: this drafter does not map them (--no-shared-features or a "
                                "CPU drafter)")
            table = open_table(offer, device=self.proposer.device)
        except WireError as e:
            self.metrics.bad_payloads.labels(reason="bad_tensor").inc()
            log.warning("shared features refused", extra={"reason": str(e)})
            return str(e)
        log.info("shared features mapped", extra={"rows": table.shape[0], "device": str(table.device)})
        self._tables[stream] = table
        return ""

    def _gather(self, step: pb.DraftStep, table: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The shared rows `step`'s updates name, by request id, copied to this drafter's GPU in one copy.
        A request's rows are contiguous in the table, so they are slices of it, joined where the table is
        mapped (open_table) when there are several: no row index to upload and no gather (a batch-1 round
        spent 0.24 ms on those, round_trace). A reference out of the table's bounds is left out: applying it
        raises."""
        if table is None:
            return {}
        refs = []  # (request id, rows)
        for update in step.updates:
            kind = update.WhichOneof("kind")
            holder = getattr(update, kind) if kind in ("new_request", "accepted") else None
            if holder is not None and holder.HasField("shared_row"):
                count = len(holder.token_ids) - (kind == "new_request")
                if count >= 0 and not unreadable_rows(table, holder.shared_row, count):
                    refs.append((update.request_id, table[holder.shared_row:holder.shared_row + count]))
        if not refs:
            return {}
        slices = [rows for _, rows in refs]
        packed = (slices[0] if len(slices) == 1 else torch.cat(slices)).to(self.proposer.device)
        round_trace.mark("d.rows_picked")
        return dict(zip((rid for rid, _ in refs), packed.split([len(rows) for rows in slices]), strict=True))

    @torch.inference_mode()
    def run_step(self, stream: int, owned: set[str], step: pb.DraftStep,
                 features: Mapping[str, torch.Tensor] | None = None, draft: bool = True) -> pb.DraftResult:
        """Applies `step`'s updates, then drafts for its wants (on the proposer's thread); draft=False answers
        a stale step with its updates applied and no drafts. features: per request id, its update's features
        as a tensor (from a co-located verifier, or gathered from the shared table) instead of the bytes in
        the update."""
        features = features or {}
        started = time.perf_counter()
        round_trace.mark("d.run")
        result = pb.DraftResult(step_id=step.step_id)
        for update in step.updates:
            key = f"{stream}/{update.request_id}"
            try:
                self._apply(key, owned, update, features.get(update.request_id), self._tables.get(stream))
            except (WireError, ProposerError, ValueError) as e:
                self._free(key, owned)
                result.dropped_request_ids.append(update.request_id)
                reason = "bad_tensor" if isinstance(e, WireError) else "unknown_request"
                self.metrics.bad_payloads.labels(reason=reason).inc()
                log.warning("update dropped", extra={"request_id": update.request_id, "reason": str(e)})
        round_trace.mark("d.applied")
        if step.HasField("queued"):
            try:
                self._draft_queued(stream, owned, step.queued, result)
            except (WireError, ProposerError, ValueError) as e:  # the verifier re-sends these requests whole
                if (shared := self._settled.get(stream)) is not None:  # its GPU may wait for these drafts
                    shared.release_drafted(step.queued.sequence)
                if self._queued:
                    self.take_drafts(owned, None)  # queued before the failure: nothing of it is kept
                for want in step.queued.wants:
                    self._free(f"{stream}/{want.request_id}", owned)
                    result.dropped_request_ids.append(want.request_id)
                reason = "link_error" if isinstance(e, SettleTimeout) else "bad_tensor"
                self.metrics.bad_payloads.labels(reason=reason).inc()
                log.warning("queued drafts refused", extra={"reason": str(e)})
        wanted = [w for w in step.wants if draft and f"{stream}/{w.request_id}" in self._known]
        wanted = list({w.request_id: w for w in wanted}.values())  # one row per request
        for serve, wants in ((self._propose, [w for w in wanted if not w.num_branches]),
                             (self._draft_tables, [w for w in wanted if w.num_branches])):
            if not wants:
                continue
            try:
                serve(stream, wants, result)
            except ProposerError as e:  # a want the proposer cannot serve: these requests get no drafts
                result.error = str(e)
        result.compute_seconds = time.perf_counter() - started
        round_trace.mark("d.answered")
        self._profiler.step()
        self.metrics.draft_step_time.observe(result.compute_seconds)
        self.metrics.num_requests.set(len(self._known))
        return result

    def _draft_queued(self, stream: int, owned: set[str], queued: pb.QueuedDrafts, result: pb.DraftResult
                      ) -> None:
        """Drafts for tokens a same-host verifier's sampler is settling now: on GPUs this one's stream waits
        until the verifier's writes the step's number into the shared slot (after copying the sampler's
        output into the shared buffer), then drafts from that output and the feature table as a co-located
        drafter does (queue_drafts); the host waits for the number, then for the drafts."""
        if queued.HasField("settled_buffer"):  # a grown buffer keeps the stream's slot and its numbering
            buffer = open_table(queued.settled_buffer, (torch.int64,), self.proposer.device).view(-1)
            if (shared := self._settled.get(stream)) is not None:
                shared.buffer = buffer
            else:
                self._settled[stream] = _SharedOutput(buffer, None)
        if queued.settled_slot and stream in self._settled:
            self._settled[stream].open_slot(queued.settled_slot, self.proposer.device)
        if queued.HasField("drafts_buffer") and stream in self._settled:
            self._settled[stream].drafts = open_table(queued.drafts_buffer, (torch.int64,),
                                                      self.proposer.device)
        if queued.drafts_slot and stream in self._settled:
            self._settled[stream].open_drafted(queued.drafts_slot, self.proposer.device)
        if stream not in self._settled or stream not in self._tables:
            raise WireError("queued drafts on a stream that offered no sampler buffer or feature table")
        shared = self._settled[stream]
        buffer, slot = shared.buffer, shared.slot
        if buffer.is_cuda != (slot is not None):
            raise WireError("queued drafts on GPUs need the verifier's slot (settled_slot), and a sampler "
                            f"buffer in host memory none: a {buffer.device.type} buffer, "
                            f"{'a' if slot else 'no'} slot")
        if slot is not None and queued.sequence <= shared.sequence:
            raise WireError(f"queued drafts: sequence {queued.sequence} does not follow {shared.sequence}")
        shape = list(queued.settled_shape)
        n, width = shape if len(shape) == 2 else (0, 0)
        if width < 2 or n * width > buffer.numel():
            raise WireError(f"queued drafts: sampler output shape {shape} does not fit "
                            f"the shared buffer of {buffer.numel()} values")
        if any(row >= n for row in queued.rows):
            raise WireError(f"queued drafts: a row past the sampler output's {n}")
        rows = len(self._tables[stream])
        if any(cell >= rows for cell in queued.feature_cells):
            raise WireError(f"queued drafts: a feature cell past the table's {rows} rows")
        wants = list(queued.wants)
        temperature = [max(w.temperature, 0.0) for w in wants]
        top_k = [min(w.top_k, self.proposer.max_top_k) if t > 0 else 0
                 for w, t in zip(wants, temperature, strict=True)]
        branches = [w.num_branches for w in wants] if wants and all(w.num_branches for w in wants) else None
        returned = slot is not None and shared.drafted is not None and shared.drafts is not None
        publish = (shared.publish_to(len(wants), self.proposer.max_drafts, queued.sequence)
                   if returned and branches else None)
        if slot is not None:
            shared.sequence = queued.sequence
            wait_value(slot, queued.sequence, torch.cuda.current_stream(self.proposer.device))
        round_trace.mark("d.value_queued")
        self.queue_drafts(stream, [w.request_id for w in wants], [w.num_drafts for w in wants], temperature,
                          top_k, buffer[:n * width].view(n, width), list(queued.rows), self._tables[stream],
                          list(queued.feature_cells), branches,
                          queued.forced_hit_rate if queued.HasField("forced_hit_rate") else None,
                          publish)
        round_trace.mark("d.queued")
        if returned:  # (after a published hit: the same ids again, and the same number)
            shared.return_drafts(self.proposer.queued_drafts(len(wants)), queued.sequence)
        if slot is not None:
            shared.await_number(queued.sequence, self.settle_timeout)
        round_trace.mark("d.settled")
        proposal = self.take_drafts(owned, self.proposer.queued_counts())
        round_trace.mark("d.taken_queued")
        if branches is not None:
            result.queued_lookups, result.queued_hits, result.tables_served = self.lookups()
        self._split(wants, proposal, temperature, top_k, result)

    # A co-located verifier's serial drafts without a DraftStep: queued on the device behind its sampler,
    # taken once it has read how many tokens each request settled (proposer.queue_after_verification).

    @torch.inference_mode()
    def queue_drafts(self, stream: int, request_ids: list[str], num_drafts: list[int],
                     temperature: list[float], top_k: list[int], settled: torch.Tensor, rows: list[int],
                     features: torch.Tensor, feature_cells: list[int], num_branches: list[int] | None = None,
                     forced_hit_rate: float | None = None,
                     publish: table_lookup.Publish | None = None) -> None:
        """Drafts for the tokens the sampler output `settled` holds for these requests (rows[b]: request b's
        row), each request's features at feature_cells[b * (max_drafts + 1):] of `features`. Every request
        must be held, with its last tokens drafted from. num_branches, forced_hit_rate, publish: tables ahead
        (EagleProposer.queue_after_verification)."""
        p, started = self.proposer, time.perf_counter()
        keys = [f"{stream}/{rid}" for rid in request_ids]
        if unknown := [rid for rid, key in zip(request_ids, keys, strict=True) if key not in self._known]:
            raise ProposerError(f"unknown request {unknown[0]!r}")
        top_k = [min(tk, p.max_top_k) if t > 0 else 0 for t, tk in zip(temperature, top_k, strict=True)]
        if num_branches is not None and (not p.max_branches or p.min_confidence):
            if not self._tables_refused:  # served as plain queued steps: said once
                log.warning("tables ahead asked for, but this drafter has no branch slots (--max-branches "
                            "0) or drafts to a confidence (--min-confidence): serial drafts only")
                self._tables_refused = True
            num_branches = None
        if num_branches is not None:
            num_branches = [min(n, p.max_branches) for n in num_branches]
        p.queue_after_verification(keys, settled, rows, features, feature_cells,
                                   [min(k, p.max_drafts) for k in num_drafts], temperature, top_k,
                                   num_branches, forced_hit_rate, publish)
        self._queued, self._queue_seconds = keys, time.perf_counter() - started

    def lookups(self) -> tuple[int, int, bool]:
        """Of the last queued step with tables ahead: how many requests had a table to look in, how many
        found their outcome there, and whether its drafts were the tables'."""
        p = self.proposer
        return p.last_lookups, p.last_hits, p.tables_served

    @torch.inference_mode()  # (with tables ahead it drafts the next tables into the proposer's buffers)
    def take_drafts(self, owned: set[str], counts: list[int] | None, on_device: bool = False
                    ) -> Proposal | None:
        """The queued drafts, once `counts` (tokens each request settled) are known (on_device: their ids
        left on the device, not waited for). counts None: the verification's result was lost, so what the
        drafter holds of these requests is unknown: they are freed (the verifier re-sends them whole) and no
        drafts come back."""
        started, keys, self._queued = time.perf_counter(), self._queued, []
        proposal = self.proposer.take_queued([0] * len(keys) if counts is None else counts, on_device)
        if counts is None:
            for key in keys:
                self._free(key, owned)
            return None
        for key, n in zip(keys, counts, strict=True):
            self._known[key] += n
        self.metrics.forward_steps_by_mode["cuda_graph" if self.proposer.graphs else "eager"].inc()
        self.metrics.draft_tokens.inc(int(proposal.num_drafts.sum()))
        self.metrics.draft_step_time.observe(self._queue_seconds + time.perf_counter() - started)
        return proposal

    def _apply(self, key: str, owned: set[str], update: pb.RequestUpdate, features: torch.Tensor | None,
               shared: torch.Tensor | None) -> None:
        kind = update.WhichOneof("kind")
        if kind == "free":
            self._free(key, owned)
            return
        if kind == "new_request":
            self._free(key, owned)  # a re-send replaces what was there
            new = update.new_request
            self.proposer.add(key, list(new.token_ids),
                              self._features(new, len(new.token_ids) - 1, features, shared))
            owned.add(key)
            self._known[key] = len(new.token_ids)
            return
        if kind != "accepted":
            raise ValueError("update without a kind")
        accepted = update.accepted
        if key not in self._known:
            raise ValueError("accepted tokens for an unknown request")
        if accepted.position != self._known[key]:
            raise ValueError(f"accepted tokens at position {accepted.position}, but the drafter holds "
                             f"{self._known[key]} tokens")
        self.proposer.update(key, list(accepted.token_ids),
                             self._features(accepted, len(accepted.token_ids), features, shared))
        self._known[key] += len(accepted.token_ids)

    def _features(self, holder: pb.NewRequest | pb.Accepted, count: int, tensor: torch.Tensor | None,
                  shared: torch.Tensor | None) -> torch.Tensor:
        """An update's `count` feature rows: handed over, named in the shared table, or its bytes."""
        if tensor is not None:  # the proposer checks its shape, as for a decoded one
            return tensor
        if holder.HasField("shared_row"):  # not gathered: out of bounds, or no table (this raises why)
            return shared_rows(shared, holder.shared_row, count)
        return decode_tensor(holder.features, dtypes=FEATURE_DTYPES, ndim=2, name="features")

    def _free(self, key: str, owned: set[str]) -> None:
        if key in self._known:
            self.proposer.free(key)
            del self._known[key]
        owned.discard(key)

    def _free_all(self, owned: set[str]) -> None:
        for key in list(owned):
            self._free(key, owned)
        self.metrics.num_requests.set(len(self._known))

    def _propose(self, stream: int, wants: list[pb.DraftWant], result: pb.DraftResult) -> None:
        p = self.proposer
        keys = [f"{stream}/{w.request_id}" for w in wants]
        # A request with no new tokens since its last proposal has nothing to draft from.
        ks = [min(w.num_drafts, p.max_drafts) if p.requests[key].num_pending else 0
              for w, key in zip(wants, keys, strict=True)]
        temperature = [max(w.temperature, 0.0) for w in wants]
        top_k = [min(w.top_k, p.max_top_k) if t > 0 else 0 for w, t in zip(wants, temperature, strict=True)]
        proposal = p.propose(keys, ks, temperature, top_k, keep_chain=any(w.keep_chain for w in wants))
        self.metrics.forward_steps_by_mode["cuda_graph" if p.graphs else "eager"].inc()
        self._split(wants, proposal, temperature, top_k, result)
        self.metrics.draft_tokens.inc(int(proposal.num_drafts.sum()))  # k clipped at the drafter's context

    def _draft_tables(self, stream: int, wants: list[pb.DraftWant], result: pb.DraftResult) -> None:
        """A speculation-cache table per want: one Proposal per branch, q as _split ships it."""
        p = self.proposer
        keys = [f"{stream}/{w.request_id}" for w in wants]
        temperature = [max(w.temperature, 0.0) for w in wants]
        tables = p.draft_branches(
            keys,
            [VERIFYING_CHAIN if w.verifying_chain else w.verifying_branch if w.HasField("verifying_branch")
             else None for w in wants],
            [min(w.num_branches, p.max_branches) for w in wants],
            [min(w.num_drafts, p.max_drafts) for w in wants],
            temperature,
            [min(w.top_k, p.max_top_k) if t > 0 else 0 for w, t in zip(wants, temperature, strict=True)],
        )
        self.metrics.forward_steps_by_mode["cuda_graph" if p.graphs else "eager"].inc()
        drafted = 0
        for w, table in zip(wants, tables, strict=True):
            for branch in table:
                message = result.proposals.add(request_id=w.request_id, draft_token_ids=branch.token_ids)
                message.branch.index, message.branch.accepted = branch.index, branch.accepted
                message.branch.bonus_token_id = branch.bonus
                drafted += len(branch.token_ids)
                if branch.q_values is None:
                    message.probs_kind = pb.PROBS_KIND_NONE
                    continue
                message.probs_kind = pb.PROBS_KIND_SPARSE
                message.sparse.indices.CopyFrom(encode_tensor(branch.q_indices))
                message.sparse.values.CopyFrom(encode_tensor(branch.q_values))
        self.metrics.draft_tokens.inc(drafted)

    def _split(self, wants: list[pb.DraftWant], proposal: Proposal, temperature: list[float],
               top_k: list[int], result: pb.DraftResult) -> None:
        """Adds one Proposal per request with drafts to `result`, q cut back to each row's own kind and width;
        the sparse rows are encoded in one go."""
        cut: list[tuple[pb.Proposal, np.ndarray, np.ndarray]] = []
        for drafts in drafts_per_request(proposal, temperature, top_k, torch.int32):
            message = result.proposals.add(request_id=wants[drafts.index].request_id,
                                           draft_token_ids=drafts.token_ids)
            if drafts.dense is not None:
                message.probs_kind = pb.PROBS_KIND_DENSE
                message.probs.CopyFrom(encode_tensor(torch.from_numpy(drafts.dense)))
            elif drafts.sparse is not None:
                message.probs_kind = pb.PROBS_KIND_SPARSE
                cut.append((message, *drafts.sparse))
            else:
                message.probs_kind = pb.PROBS_KIND_NONE
        if cut:
            indices = encode_arrays([(i, torch.int32) for _, i, _ in cut], torch.int32)
            values = encode_arrays([(v, torch.float32) for _, _, v in cut], torch.float32)
            for (message, _, _), i, v in zip(cut, indices, values, strict=True):
                message.sparse.indices.CopyFrom(i)
                message.sparse.values.CopyFrom(v)
