"""Features shared in GPU memory (specwire.shared_features): a drafter on the verifier's host maps the
verifier's feature table once per stream, and the steps name rows of it instead of carrying bytes.

On the CPU the protocol runs whole, over real gRPC between a real verifier link and a real drafter service,
with only the CUDA mapping swapped for an in-process lookup of the same table: the drafter must be handed
the target's own feature for every token (the check of test_colocated_features), also for requests re-sent
whole after the stream broke (the table outlives it), and a drafter that cannot map gets bytes and loses no
request. On a GPU machine the mapping itself: a table described here is opened
by another process, which reads the same rows and copies them to another GPU, as a drafter does.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
from specwire.drafter import server as drafter_server
from specwire.verifier import drafter_link
from specwire.verifier.drafter_link import DrafterLink
from specwire.verifier.scheduler import Scheduler, SchedulerConfig
from test_cache_statistics import assert_follows_the_target, bigram_drafter_and_target, sample_many
from test_colocated_features import (
    MAX_TOKENS,
    REQUESTS,
    SLOTS,
    K,
    assert_handed_the_target_features,
    drafter_service,
    generate,
    recording_drafter,
    recording_queued,
)
from test_metrics import _scrape

from specwire import grpc_common
from specwire.metrics import DRAFTING_MODES, DrafterMetrics, VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.shared_features import describe, host_id, open_table
from specwire.stream_values import HostSlot
from specwire.synthetic import synthetic_tokenizer
from specwire.v1 import drafter_pb2 as pb
from specwire.v1 import drafter_pb2_grpc
from specwire.wire import WireError, encode_tensor

LONG = 100  # tokens a request generates where a stream breaks mid-run: live requests outlast the reconnect


@pytest.fixture
def in_process_mapping(monkeypatch):
    """describe / open_table by a lookup of the very table (CUDA IPC cannot map within one process)."""
    tables = {}

    def fake_describe(table):
        key = f"in-process-{len(tables)}"
        tables[key] = table
        return pb.SharedFeatures(device_uuid=key, shape=list(table.shape), dtype=pb.DTYPE_FLOAT32)

    monkeypatch.setattr(drafter_link, "describe", fake_describe)
    monkeypatch.setattr(drafter_server, "open_table", lambda message, *_, **__: tables[message.device_uuid])
    return tables


@pytest.fixture
def refused_offer(monkeypatch) -> list:
    """describe offers a well-formed table no GPU holds, which the CPU drafter's real open_table refuses; the
    list gets each table offered."""
    offered = []

    def offer(table):
        offered.append(table)
        return pb.SharedFeatures(device_uuid="GPU-none", shape=list(table.shape), dtype=pb.DTYPE_FLOAT32,
                                 storage_size_bytes=table.numel() * 4)

    monkeypatch.setattr(drafter_link, "describe", offer)
    return offered


def says_it_maps(service: drafter_server.DrafterService) -> None:
    """What a GPU drafter on this host that sees the verifier's device says in its handshake."""
    service.info.shared_features_host = host_id()
    service.info.shared_features_gpus.append("cpu")


@contextlib.asynccontextmanager
async def serving(service, listen: str = "127.0.0.1:0"):
    """The drafter service behind a real gRPC server on `listen` (default a free loopback port)."""
    server = grpc_common.GrpcServer(grpc_common.ServerOptions(listen=listen))
    server.add_service(grpc_common.DRAFTER_SERVICE, drafter_pb2_grpc.add_DrafterServicer_to_server, service)
    port = await server.start()
    await server.set_serving(True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.drain(0)


async def generate_over_grpc(service, engine, cache_branches: int, metrics: VerifierMetrics,
                             max_tokens: int = MAX_TOKENS, queue_drafts: bool = False,
                             drafting_epoch: int = 0, drafting_modes: tuple[str, ...] | None = None,
                             **config):
    async with serving(service) as target:
        link = DrafterLink(target, metrics, step_timeout=5.0, share_from=engine.device)
        return link, await generate(engine, link, cache_branches, queue_drafts, max_tokens=max_tokens,
                                    drafting_epoch=drafting_epoch, drafting_modes=drafting_modes,
                                    metrics=metrics, **config)


@pytest.mark.parametrize("cache_branches", [0, 4], ids=["serial", "tables"])
def test_rows_named_in_the_shared_table_are_the_target_features(in_process_mapping, cache_branches):
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", cache_branches, 0)
    service = drafter_service(proposer, config)
    says_it_maps(service)
    metrics = VerifierMetrics()
    shared = []  # the gauge's values, in order
    gauge_set = metrics.drafter_features_shared.set
    metrics.drafter_features_shared.set = lambda value: (shared.append(value), gauge_set(value))
    link, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, cache_branches, metrics))
    assert link.feature_device == engine.device and not link.share_refused
    assert shared == [1, 0], "the gauge: 1 at the handshake, 0 when the stream closed with the scheduler"
    assert len(in_process_mapping) == 1, "one table offered, on the stream's first step"
    # a stream's id is its number on the drafter: the only stream here is 0
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu")
    # the steps named rows: a token's features (3 x 64 float32) would have made them far larger
    sent = metrics.rpc_bytes["sent"]._value.get()
    tokens = sum(len(t) for t in outputs)
    assert sent < tokens * 3 * config.hidden_size * 4 / 4, f"{sent} bytes sent for {tokens} tokens"


def queuing_drafter(branches: int):
    """recording_drafter's (config, sd, head, engine, proposer, handed) for a CPU drafter service that maps
    the table and says it queues, with the keys it queued for (filled as it runs) and the service."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", branches, 0)
    queued = recording_queued(proposer, handed)
    service = drafter_service(proposer, config)
    says_it_maps(service)
    service.info.queues_drafts = True
    return (config, sd, head, engine, proposer, handed), queued, service


def test_drafts_queued_behind_the_sampler_across_processes_read_what_it_settled(in_process_mapping):
    """A drafter that maps the table and says it queues gets its serial steps as the verification starts,
    with the sampler's output shared instead of the tokens (on a GPU its stream waits for the verifier's
    event; a CPU's copy is done when it returns). It must be handed the target's features of every token,
    read from the shared table at the cells the step names, and the outputs must be those of serial steps
    sent after the verification."""
    (config, sd, head, engine, _, handed), queued, service = queuing_drafter(0)
    _, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, VerifierMetrics(),
                                                     queue_drafts=True))
    assert queued, "no drafts were queued behind a sampler"
    assert len(in_process_mapping) == 2, "the feature table and the sampler's buffer, each offered once"
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu")
    config2, sd2, head2, engine2, proposer2, _ = recording_drafter("cpu", "cpu", 0, 0)
    plain = drafter_service(proposer2, config2)
    says_it_maps(plain)
    reference, _ = asyncio.run(generate_over_grpc(plain, engine2, 0, VerifierMetrics()))[1]
    assert outputs == reference


def test_a_last_round_does_not_wait_for_drafts_it_has_no_room_for(in_process_mapping, monkeypatch):
    """A round whose every row has one token left (no room for drafts) is verified at once: the drafts
    queued behind the last sampler, which it cannot use, are awaited after it, only for what became of the
    requests. Waiting for them first cost the 8B shape 3.4 ms of a request's 220 at batch 1 (session 47).
    Every draft is rejected (forced): a round settles one token, and each request ends with such a round."""
    events = []
    arrive, verify = drafter_link.QueuedDrafts.arrive, Scheduler._verify

    async def recording_arrive(self, drafts=True):
        events.append(("arrive", drafts))
        await arrive(self, drafts)

    async def recording_verify(self, live, batch, *args):
        events.append(("verify", sum(batch.num_drafts)))
        return await verify(self, live, batch, *args)

    monkeypatch.setattr(drafter_link.QueuedDrafts, "arrive", recording_arrive)
    monkeypatch.setattr(Scheduler, "_verify", recording_verify)
    (config, sd, head, engine, _, handed), queued, service = queuing_drafter(0)
    metrics = VerifierMetrics()
    _, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, metrics, queue_drafts=True,
                                                     forced_acceptance=(0.0, 0.0, 0.0)))
    assert queued, "no drafts were queued behind a sampler"
    # one token a round: every request's tokens after its first came from as many verifications of it
    assert metrics.verified_rows._value.get() == REQUESTS * (MAX_TOKENS - 1)
    deferred = [i for i, event in enumerate(events) if event == ("arrive", False)]
    assert deferred, "no answer was left until after a last round"
    assert all(events[i - 1] == ("verify", 0) for i in deferred), events
    # a round with drafts waited for them first: the answer (drafts read) came before its verification
    assert ("arrive", True) in events and all(events[i + 1:i + 2] != [("verify", 0)]
                                              for i, event in enumerate(events) if event == ("arrive", True))
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu")


def test_tables_ahead_across_processes_are_asked_for_looked_up_and_counted(in_process_mapping):
    """--queued-tables over a gRPC stream: the queued steps ask for tables ahead (their wants' num_branches,
    the forced hit rate), the drafter looks them up and says in its answers how many hit and whether the
    round's drafts were the tables', which the verifier counts; the drafter is still handed the target's
    features of every token (gathered by its queued drafting, then committed by its tables)."""
    (config, sd, head, engine, proposer, handed), queued, service = queuing_drafter(4)
    proposer.uniform_outcomes = True  # a random head's q puts every branch at 0 accepted (forced rates here)
    metrics = VerifierMetrics()
    _, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, metrics, queue_drafts=True,
                                                     queued_tables=4, forced_hit_rate=1.0))
    assert queued, "no drafts were queued behind a sampler"
    hits, misses = metrics.cache["hit"]._value.get(), metrics.cache["miss"]._value.get()
    served = metrics.tables_ahead_served._value.get()
    assert hits > 0 and served > 0 and hits + misses >= served, (hits, misses, served)
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu")


@pytest.mark.parametrize("modes", [DRAFTING_MODES, None], ids=["all_modes", "default_modes"])
def test_an_adaptive_verifier_queues_its_serial_epochs_across_processes(in_process_mapping, modes):
    """The adaptive drafting mode (epochs of 3 rounds of tables, serial drafting, none) queues its serial
    epochs' drafts behind the sampler over the real link: the drafter is still handed the target's features
    of every token, through table, serial, queued and draftless rounds alike. By default (modes None) the
    tables take no part once the drafter says it queues."""
    (config, sd, head, engine, _, handed), queued, service = queuing_drafter(4)
    metrics = VerifierMetrics()
    link, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 4, metrics, queue_drafts=True,
                                                        drafting_epoch=3, drafting_modes=modes))
    assert queued, "no drafts were queued behind a sampler"
    assert link.epoch == 1 and metrics.bad_payloads.labels(reason="link_error")._value.get() == 0
    ran = {m for m in DRAFTING_MODES if metrics.drafting_rounds[m]._value.get() > 0}
    assert ran == set(modes or ("serial", "none")), ran
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu")


def test_sampled_tokens_through_drafts_queued_across_processes_follow_the_target(in_process_mapping):
    """test_cache_statistics' check with the drafter behind the real gRPC link, its serial drafts queued
    behind each sampler (DraftStep.queued): their q comes back in the drafter's answer, not as the proposal
    the drafter left on a shared device. With that q cubed (renormalised) in the drafter's queued answers
    only, position 4 failed (2026-11-27)."""
    engine, proposer, service = bigram_drafter_and_target("cpu")
    says_it_maps(service)
    service.info.queues_drafts = True
    metrics = VerifierMetrics()

    async def run() -> list[list[int]]:
        async with serving(service) as target:
            link = DrafterLink(target, metrics, step_timeout=5.0, share_from=engine.device)
            return await sample_many(engine, link, metrics, queued=True)

    outputs = asyncio.run(run())
    assert metrics.queued_drafts._value.get() > 1000
    assert_follows_the_target(engine, metrics, outputs)


def test_malformed_queued_drafts_are_refused_and_their_requests_dropped(in_process_mapping, caplog):
    """Queued drafts the drafter cannot serve (no sampler buffer offered, a shape the buffer cannot hold, a
    row or feature cell out of range, a slot path that is not a slot or not there) drop their requests with
    the reason logged, and the drafter serves on: the verifier then sends those requests whole."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service, owned = drafter_service(proposer, config), set()
    width = head.config.feature_dim

    def hold(rid: str) -> None:
        step = pb.DraftStep(step_id=1)
        new = step.updates.add(request_id=rid).new_request
        new.token_ids.extend([5, 6, 7])
        new.features.CopyFrom(encode_tensor(torch.zeros(2, width)))
        assert not service.run_step(0, owned, step).dropped_request_ids

    def queued_step(**fields) -> pb.DraftStep:
        step = pb.DraftStep(step_id=2)
        step.queued.wants.add(request_id="a", num_drafts=2)
        step.queued.rows.append(fields.get("row", 0))
        step.queued.feature_cells.extend([fields.get("cell", 0)] * (K + 1))
        step.queued.settled_shape.extend(fields.get("shape", [1, K + 2]))
        if "buffer" in fields:
            step.queued.settled_buffer.CopyFrom(drafter_link.describe(fields["buffer"]))
        step.queued.settled_slot = fields.get("slot", "")
        return step

    service._tables[0] = torch.zeros(16, width)  # a mapped feature table (the stream offered one)
    buffer = torch.zeros(8, 1, dtype=torch.int64)
    slot = HostSlot()  # a real slot, offered with a sampler buffer in host memory: nothing waits on it there
    for step, reason in [(queued_step(), "offered no sampler buffer"),
                         (queued_step(buffer=buffer, shape=[4, 3]), "does not fit"),
                         (queued_step(buffer=buffer, row=1), "a row past"),
                         (queued_step(buffer=buffer, shape=[1, 3], cell=16), "a feature cell past"),
                         (queued_step(buffer=buffer, slot="/etc/passwd"), "cannot map the verifier's slot"),
                         (queued_step(buffer=buffer, slot="/dev/shm/specwire-slot-gone"), "cannot map"),
                         (queued_step(buffer=buffer, slot=slot.path), "a cpu buffer, a slot")]:
        hold("a")
        caplog.clear()
        result = service.run_step(0, owned, step)
        assert list(result.dropped_request_ids) == ["a"] and "0/a" not in service._known, reason
        assert reason in next(r.reason for r in caplog.records if r.msg == "queued drafts refused")
    hold("a")  # and it serves on
    assert "0/a" in service._known
    assert not os.path.exists(slot.path), "the drafter unlinks a slot it mapped"
    slot.close()


def queue_over_grpc(service_class: type) -> tuple:
    """LONG requests through the real gRPC link to a `service_class` drafter that maps the features and queues
    drafts (serial drafting, queued on): config, sd, head, handed, the service, the link and the outputs."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service = service_class(DrafterMetrics())
    service.load(proposer, config, synthetic_tokenizer(config).fingerprint, "eagle3:random")
    says_it_maps(service)
    service.info.queues_drafts = True
    link, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, VerifierMetrics(), LONG, True))
    return config, sd, head, handed, service, link, outputs


class BrokenOnQueuedDrafter(drafter_server.DrafterService):
    """Ends its first stream with an error at its 3rd step of queued drafts: their answer never comes."""

    queued_steps = 0

    def run_step(self, stream, owned, step, features=None, draft=True):
        if step.HasField("queued"):
            self.queued_steps += 1
            if self.queued_steps == 3:
                raise RuntimeError("the drafter went away")
        return super().run_step(stream, owned, step, features, draft)


def test_queued_drafts_whose_answer_is_lost_cost_no_request(in_process_mapping):
    """The stream breaks while drafts are queued: their requests are sent whole on the next stream, which
    is offered the table and the sampler's buffer again, and the drafter is handed the target's features.
    (Outputs are not compared with another run: the forced acceptance of `generate` takes the drafts it
    is given, and a round whose drafts were lost has none.)"""
    config, sd, head, handed, service, link, outputs = queue_over_grpc(BrokenOnQueuedDrafter)
    assert service.queued_steps > 3 and link.epoch == 2
    assert len(in_process_mapping) == 4, "the table and the buffer, offered on each stream"
    resent = {int(key.split("/")[1]) for key in handed if key.startswith("1/")}
    assert resent == set(range(len(outputs))), "every live request is sent whole on the new stream"
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu", stream=1, only=resent,
                                      max_tokens=LONG)


class RefusingOnceQueuedDrafter(drafter_server.DrafterService):
    """Refuses its 3rd step of queued drafts as it would a stalled verifier's (its requests dropped, the
    stream kept); records that step's requests and how often each request is added."""

    queued_steps = 0
    refused: list[str] = []
    added: Counter

    def _draft_queued(self, stream, owned, queued, result):
        self.queued_steps += 1
        if self.queued_steps == 3:
            self.refused = [w.request_id for w in queued.wants]
            raise WireError("queued drafts: the verifier's sampler did not settle step 3 in 10 s")
        super()._draft_queued(stream, owned, queued, result)

    def load(self, proposer, *args):
        super().load(proposer, *args)
        self.added, add = Counter(), proposer.add
        proposer.add = lambda key, *rest: (self.added.update([key]), add(key, *rest))[1]


def test_requests_of_a_refused_queued_step_are_sent_whole_next_step(in_process_mapping):
    """A queued step the drafter refuses (dropping its requests) costs those requests that round's drafts:
    the verifier's next step sends them whole, not as tokens to append to what the drafter no longer holds,
    and every other request is handed the target's features of every token."""
    config, sd, head, handed, service, link, outputs = queue_over_grpc(RefusingOnceQueuedDrafter)
    assert link.epoch == 1 and service.queued_steps > 6 and service.refused
    unknown = service.metrics.bad_payloads.labels(reason="unknown_request")._value.get()
    assert unknown == 0, f"{unknown} updates for requests the drafter had dropped"
    assert all(service.added[f"0/{rid}"] == 2 for rid in service.refused), service.added
    others = {i for i in range(len(outputs)) if str(i) not in service.refused}
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu", only=others, max_tokens=LONG)


class OnceBrokenDrafter(drafter_server.DrafterService):
    """Ends its first stream with an error at its 6th step, as a drafter restart would."""

    steps = 0

    def run_step(self, stream, owned, step, features=None, draft=True):
        self.steps += 1
        if self.steps == 6:
            raise RuntimeError("the drafter went away")
        return super().run_step(stream, owned, step, features, draft)


def test_after_a_reconnect_live_requests_are_re_sent_whole_from_the_same_table(in_process_mapping):
    """The store outlives the stream: the next stream is offered the same table, and the requests the first
    held are re-sent whole as row references into it, handed to the drafter as the target's features."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service = OnceBrokenDrafter(DrafterMetrics())
    service.load(proposer, config, synthetic_tokenizer(config).fingerprint, "eagle3:random")
    says_it_maps(service)
    link, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, VerifierMetrics(), LONG))
    assert service.steps > 6 and link.epoch == 2 and not link.share_refused
    assert len(in_process_mapping) == 2  # offered again on the new stream: the same table
    first, second = in_process_mapping.values()
    assert first.data_ptr() == second.data_ptr() and first.shape == second.shape
    resent = {int(key.split("/")[1]) for key in handed if key.startswith("1/")}
    started_before = {int(key.split("/")[1]) for key in handed if key.startswith("0/")}
    assert resent & started_before, "no request that the broken stream held was re-sent"
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu", stream=1, only=resent,
                                      max_tokens=LONG)


def test_a_drafter_that_cannot_map_gets_bytes_and_every_request_completes(refused_offer):
    """A CPU drafter that says it maps (as one whose GPU cannot see the verifier's would): the real
    open_table refuses, the link starts over with bytes, and the drafter is handed the target's features."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service = drafter_service(proposer, config)
    says_it_maps(service)
    link, (outputs, _) = asyncio.run(generate_over_grpc(service, engine, 0, VerifierMetrics(), LONG))
    assert len(refused_offer) == 1 and "shared features" in link.share_refused
    assert link.feature_device is None, "the stream after the refusal carries bytes"
    assert all(len(t) > LONG for t in outputs)  # every request ran to max_tokens
    # requests admitted after the refusal are drafted from bytes on the next stream (1), target features all;
    # those the refused stream held go undrafted (their features are in the table, not on the host)
    late = {int(key.split("/")[1]) for key in handed if key.startswith("1/")}
    assert late, "the drafter was never handed features as bytes after the refusal"
    assert_handed_the_target_features(handed, outputs, config, sd, head, "cpu", stream=1, only=late,
                                      max_tokens=LONG)


def test_a_row_reference_without_a_table_is_dropped_with_its_reason():
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service = drafter_service(proposer, config)

    def step_naming_row_0(step_id: int, request_id: str) -> pb.DraftStep:
        step = pb.DraftStep(step_id=step_id)
        update = step.updates.add(request_id=request_id)
        update.new_request.token_ids.extend([5, 6, 7])
        update.new_request.shared_row = 0
        return step

    async def run():
        async with serving(service) as target, grpc.aio.insecure_channel(target) as channel:
            call = drafter_pb2_grpc.DrafterStub(channel).Draft()
            step = step_naming_row_0(1, "a")
            offer = step.shared_features
            offer.device_uuid, offer.dtype = "GPU-x", pb.DTYPE_FLOAT32
            offer.shape.extend([8, 3 * config.hidden_size])
            await call.write(step)
            first = await call.read()
            await call.write(step_naming_row_0(2, "b"))
            second = await call.read()
            await call.done_writing()
            return first, second

    first, second = asyncio.run(run())
    assert "does not map them" in first.shared_features_error  # a CPU drafter says so in the handshake
    assert list(first.dropped_request_ids) == ["a"] and list(second.dropped_request_ids) == ["b"]
    assert not second.shared_features_error and not handed
    with pytest.raises(WireError, match="offered no shared table"):
        drafter_server.shared_rows(None, 0, 2)
    with pytest.raises(WireError, match=r"shared rows \[6, 10\) past the table's 8"):
        drafter_server.shared_rows(torch.zeros(8, 4), 6, 4)


CHILD = """
import sys, numpy as np, torch
from specwire.shared_features import open_table
from specwire.v1 import drafter_pb2 as pb
device = torch.device("cuda:0")  # the first GPU, as a drafter's
table = open_table(pb.SharedFeatures.FromString(sys.stdin.buffer.read()), device=device)
rows = table.index_select(0, torch.arange(3, 7, device=table.device)).to(device)  # as a drafter gathers them
table[60:62] = torch.full((2, table.shape[1]), 7, dtype=table.dtype, device=table.device)  # and writes drafts
torch.cuda.synchronize(device)
sys.stdout.buffer.write(f"{table.device}\\n".encode() + rows.float().cpu().numpy().tobytes())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_another_process_maps_the_table_on_its_own_gpu_and_reads_and_writes_its_rows():
    """A drafter on another GPU that can reach the verifier's (peer access) maps the table into its own GPU's
    context, so its reads and writes are that GPU's work and none of it runs on the verifier's GPU."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    table = torch.randn(64, 96, device=device).to(torch.bfloat16)
    offer = describe(table)
    assert offer.device_uuid and list(offer.shape) == [64, 96]
    child = subprocess.run([sys.executable, "-c", CHILD], input=offer.SerializeToString(),
                           capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    where, data = child.stdout.split(b"\n", 1)
    peers = device.index != 0 and torch.cuda.can_device_access_peer(0, device.index)
    assert where.decode() == ("cuda:0" if peers else str(device))
    got = np.frombuffer(data, dtype=np.float32).reshape(4, 96)
    np.testing.assert_array_equal(got, table[3:7].float().cpu().numpy())
    assert (table[60:62] == 7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_table_of_a_gpu_this_process_cannot_see_is_refused_by_name():
    table = torch.zeros(4, 8, device="cuda")
    offer = describe(table)
    offer.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(WireError, match="is not visible to this drafter"):
        open_table(offer)


def test_requests_begun_before_the_drafter_stay_undrafted_across_a_refusal(refused_offer):
    """Requests prefilled before the drafter came keep their features on the host; a sharing stream cannot
    use them and its verifications write the store, so their host rows stop being whole. After the drafter
    refuses the table they must not be sent as bytes with rows missing (the drafter would drop them and the
    verifier re-send them whole every step): they finish undrafted; later requests are drafted from bytes."""
    config, sd, head, engine, proposer, handed = recording_drafter("cpu", "cpu", 0, 0)
    service = drafter_service(proposer, config)
    says_it_maps(service)
    with socket.socket() as s:  # a free port, for a drafter that comes after the first requests
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)

    async def run():
        link = DrafterLink(f"127.0.0.1:{port}", VerifierMetrics(), step_timeout=5.0, share_from=engine.device,
                           backoff=(0.05, 0.2))
        scheduler = Scheduler(engine, synthetic_tokenizer(config), VerifierMetrics(),
                              SchedulerConfig(num_speculative_tokens=K, cache_branches=0,
                                              forced_acceptance=(0.9, 0.8, 0.7)), link)
        scheduler.start()
        try:
            early = [scheduler.submit([5 + i, 6, 7, 8], params, request_id=f"early{i}") for i in range(SLOTS)]
            for r in early:
                await r.outputs.get()  # prefilled: its features are on the host
            async with serving(service, f"127.0.0.1:{port}"):
                while not link.share_refused:
                    await asyncio.sleep(0.01)
                later = [scheduler.submit([9, 10 + i, 11], params, request_id=f"later{i}")
                         for i in range(SLOTS)]
                for r in early + later:
                    while (await r.outputs.get()).finish_reason is None:
                        pass
                return early, later
        finally:
            await scheduler.close()

    early, later = asyncio.run(run())
    assert len(refused_offer) == 1 and all(len(r.tokens) - len(r.prompt) == LONG for r in early + later)
    assert not [key for key in handed if "early" in key], "a request begun before the drafter was drafted"
    streams = {key.split("/")[0] for key in handed}
    assert streams == {"1"}, f"later requests drafted on the stream after the refusal only, got {streams}"
    outputs = [r.tokens for r in later]
    handed_later = {f"1/{i}": handed[f"1/later{i}"] for i in range(SLOTS)}
    assert_handed_the_target_features(handed_later, outputs, config, sd, head, "cpu", stream=1,
                                      max_tokens=LONG)


class _DraftsOnTheHost(drafter_link.DeviceDrafts):
    """DeviceDrafts with the GPU's wait swapped out (a CPU has no stream to wait on): the ids are read from
    the buffer as it is, here garbage, as a drafter that refused its step would leave it."""

    reads: list[list[tuple[int, int]]] = []  # every read's rows, in order

    def read(self, rows: list[tuple[int, int]], vocab_size: int) -> torch.Tensor:
        self.reads.append(rows)
        return self.pick(self.buffer, rows, self.width, vocab_size)


def _device_read_drafter(monkeypatch, carry_rows: int = 0):
    """A real gRPC drafter that queues behind the sampler, and a verifier engine whose queued drafts are
    'read on the device' (Scheduler._drafts_on_device and _beside_device_drafts) from a buffer of garbage
    (ids out of the vocabulary too, which must be clamped), the GPU's wait swapped out. Returns (engine,
    run): run(link_factory or None, metrics, submits) serves the submits (prompt, max_tokens, after: the
    tokens request 0 has when it is submitted) on a scheduler, speculating over the link if one is made, and
    returns each request's tokens; aborts {i: n}: request i is aborted once it has n output tokens;
    launch_ahead: SchedulerConfig's."""
    config, sd, head, engine, proposer, _ = recording_drafter("cpu", "cpu", 0, carry_rows)
    service = drafter_service(proposer, config)
    says_it_maps(service)
    service.info.queues_drafts = True
    garbage = torch.randint(0, config.vocab_size, (SLOTS * K, 1), generator=torch.Generator().manual_seed(3))
    garbage[::3], garbage[1::3] = config.vocab_size + 3, -5
    take = DrafterLink.take_drafts

    def take_with_device_drafts(self, *args):
        queued = take(self, *args)
        queued.on_device = _DraftsOnTheHost(garbage, None, 0, K, None, 0.0)
        return queued

    monkeypatch.setattr(DrafterLink, "take_drafts", take_with_device_drafts)
    monkeypatch.setattr(DrafterLink, "drafts_readable_on_device", True)
    _DraftsOnTheHost.reads = []

    async def serve(link: DrafterLink | None, metrics: VerifierMetrics, submits, aborts: dict[int, int],
                    launch_ahead: bool) -> list[list[int]]:
        scheduler = Scheduler(engine, synthetic_tokenizer(config), metrics,
                              SchedulerConfig(num_speculative_tokens=K if link else 0, cache_branches=0,
                                              queue_drafts=True, launch_ahead=launch_ahead), link)
        scheduler.start()
        try:
            while link is not None and not link.connected:
                await asyncio.sleep(0.01)
            requests = []
            for i, (prompt, max_tokens, after) in enumerate(submits):
                while requests and len(requests[0].tokens) < len(submits[0][0]) + after:
                    await asyncio.sleep(0.001)
                requests.append(scheduler.submit(prompt, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True), request_id=str(i)))
            while aborts and any(r.live for r in requests):
                for i, n in aborts.items():
                    if len(requests[i].tokens) - len(requests[i].prompt) >= n:
                        scheduler.abort(requests[i].id)
                await asyncio.sleep(0)
            for r in requests:
                while (await r.outputs.get()).finish_reason is None:
                    pass
            return [r.tokens for r in requests]
        finally:
            await scheduler.close()

    async def run(speculating: bool, metrics: VerifierMetrics, submits, aborts: dict[int, int] | None = None,
                  launch_ahead: bool = True) -> list[list[int]]:
        if not speculating:
            return await serve(None, metrics, submits, aborts or {}, launch_ahead)
        async with serving(service) as target:
            link = DrafterLink(target, metrics, step_timeout=5.0, share_from=engine.device,
                               drafts_on_device=True)
            return await serve(link, metrics, submits, aborts or {}, launch_ahead)

    return config, run


def _chat_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 30_000, (int(n),), generator=g).tolist() for n in lengths]


def test_greedy_output_is_the_targets_whatever_the_drafts_read_on_the_device(in_process_mapping, monkeypatch):
    """The scheduler's path for drafts read on the device (Scheduler._drafts_on_device, the answer awaited
    after the round), through a real gRPC drafter that queues behind the sampler, with the GPU's wait
    swapped out and garbage in the buffer: greedy output must be target-only's, the device reads must have
    happened, also with rows cut to their room (the requests end at different rounds), and every request
    must end."""
    _, run = _device_read_drafter(monkeypatch)
    prompts = _chat_prompts((6, 19, 11))
    lengths = [LONG, LONG - 6, LONG - 3]  # requests end at different rounds
    submits = [(p, n, 0) for p, n in zip(prompts, lengths, strict=True)]
    metrics = VerifierMetrics()
    outputs = asyncio.run(run(True, metrics, submits))
    assert metrics.registry.get_sample_value("specwire_queued_drafts_read_on_device_total") > 10
    assert outputs == asyncio.run(run(False, VerifierMetrics(), submits))
    assert [len(t) - len(p) for t, p in zip(outputs, prompts, strict=True)] == lengths
    reads = _DraftsOnTheHost.reads
    assert any(n < K for rows in reads for _, n in rows), "no read of rows cut to their room"


def test_rounds_launched_before_the_tokens_are_back_keep_greedy_output(in_process_mapping, monkeypatch):
    """Scheduler._launch_ahead: in the steady state of a batch reading its drafts on the device, each round's
    forward is launched before the last round's tokens are back, its first tokens and positions taken from
    that round's sampler output. Greedy output must be target-only's, with requests that end at different
    rounds (a row near its length limit verifies fewer drafts) and one aborted mid-run (its row is verified
    once more, for nothing, its output a prefix of target-only's); every round but those next to a
    request's start and end must have been launched ahead, and none with --launch-ahead off."""
    _, run = _device_read_drafter(monkeypatch)
    prompts = _chat_prompts((6, 19, 11))
    n = 60
    submits = [(prompts[0], n, 0), (prompts[1], n - 7, 0), (prompts[2], n, 0)]
    reference = asyncio.run(run(False, VerifierMetrics(), submits))
    metrics = VerifierMetrics()
    outputs = asyncio.run(run(True, metrics, submits, aborts={2: 25}))
    assert outputs[:2] == reference[:2]
    aborted = outputs[2][len(prompts[2]):]
    assert 25 <= len(aborted) < n and outputs[2] == reference[2][:len(outputs[2])]
    sample = metrics.registry.get_sample_value
    ahead = sample("specwire_verifications_launched_ahead_total")
    # Not launched ahead: the first round, the one the abort lands in, request 1's last (no room for drafts
    # to queue) and the one after it, request 0's last two (none to read): 6 of 59. Before session 48, when
    # a row within k + 2 tokens of its end kept the whole batch from it: 15.
    assert sample("specwire_verify_step_seconds_count") - ahead <= 7, "rounds not launched ahead"

    metrics, short = VerifierMetrics(), [(p, 20, 0) for p, _, _ in submits[:2]]
    outputs = asyncio.run(run(True, metrics, short, launch_ahead=False))
    assert outputs == [r[:len(p) + 20] for r, (p, _, _) in zip(reference, short, strict=False)]
    assert metrics.registry.get_sample_value("specwire_verifications_launched_ahead_total") == 0


@pytest.mark.parametrize("carry_rows", [0, 32], ids=["prefill steps", "prompts carried"])
@pytest.mark.parametrize("late_answers", [False, True], ids=["", "late answers to new prompts"])
def test_requests_joining_a_batch_that_reads_its_drafts_on_the_device_keep_greedy_output(
        in_process_mapping, monkeypatch, carry_rows, late_answers):
    """Requests arrive while others' drafts are read on the device (_beside_device_drafts): the others keep
    reading theirs there, a new request verifies without drafts (after a prefill step) or sits a round out
    until its own step's answer is in, then joins with that answer's drafts beside the garbage read on the
    device. Greedy output must be target-only's, arrivals must have sat out, and only the first request's
    first rounds may wait for the drafter's answers instead of reading on the device: also where the answer
    to a new prompt's step comes later than the round it sat out (late_answers), when the next round waits
    for that answer alone (before session 48 it waited for every answer and read nothing on the device)."""
    _, run = _device_read_drafter(monkeypatch, carry_rows)
    if late_answers:
        send = DrafterLink.send

        def late_for_new_prompts(self, step, features):
            future = send(self, step, features)
            if future is None or not any(u.HasField("new_request") for u in step.updates):
                return future
            late = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda answered: asyncio.get_running_loop().call_later(
                0.3, lambda: late.done() or late.set_result(answered.result())))
            return late

        monkeypatch.setattr(DrafterLink, "send", late_for_new_prompts)
    prompts = _chat_prompts((6, 19, 11, 8))
    submits = [(prompts[0], LONG, 0), (prompts[1], 60, 10), (prompts[2], 40, 25), (prompts[3], 30, 40)]
    metrics = VerifierMetrics()
    outputs = asyncio.run(run(True, metrics, submits))
    assert outputs == asyncio.run(run(False, VerifierMetrics(), submits))
    assert [len(t) - len(p) for t, p in zip(outputs, prompts, strict=True)] == [n for _, n, _ in submits]
    sample = metrics.registry.get_sample_value
    assert (sample("specwire_prompts_carried_total") > 0) == (carry_rows > 0)
    assert sample("specwire_queued_drafts_sat_out_total") >= 1, "no arrival sat a round out"
    # Rounds that waited for the drafter's answer: the first request's first ones (nothing queued yet: 2
    # here). Before _beside_device_drafts each arrival made one more, two after a prefill step.
    verifications = sample("specwire_verify_step_seconds_count")
    assert verifications - sample("specwire_queued_drafts_read_on_device_total") <= 2


def _greedy_outputs(port: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from a verifier process, one request at a time."""
    from specwire.v1 import generation_pb2 as gpb
    from specwire.v1 import generation_pb2_grpc

    outputs = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for prompt in prompts:
            request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            tokens = []
            for response in stub.Generate(request, timeout=120):
                assert response.WhichOneof("event") != "error", response.error.message
                if response.WhichOneof("event") == "chunk":
                    tokens += response.chunk.token_ids
            outputs.append(tokens)
    return outputs


@contextlib.contextmanager
def _queued_processes(tmp_path, *verifier_args: str):
    """Real processes on the GPUs: a drafter on the first, a verifier queuing its drafts on it (over the step
    socket) and reading them on its GPU (with `verifier_args`), and a target-only verifier on the last.
    Yields (drafter, verifier, target, verifier's metrics port)."""
    from specwire.commands.demo import free_port, start, stop, wait_drafter_connected, wait_serving

    gpus, model, socket_path = torch.cuda.device_count(), "synthetic:tiny", str(tmp_path / "drafter.sock")
    metrics_port = free_port()
    drafter = start("drafter", ["drafter", "--model", model, "--device", "cuda:0", "--step-socket",
                                socket_path, "--metrics-port", str(free_port())], tmp_path)
    services = [drafter]
    try:
        wait_serving([drafter], 240)
        verifier = start("verifier", ["verifier", "--model", model, "--device", f"cuda:{gpus - 1}",
                                      "--drafter", f"127.0.0.1:{drafter.port}", "--drafter-socket",
                                      socket_path, "--cache-branches", "0", "--queue-drafts", "on",
                                      "--drafts-on-device", "on", "--metrics-port", str(metrics_port),
                                      *verifier_args],
                         tmp_path)
        target = start("target", ["verifier", "--model", model, "--device", f"cuda:{gpus - 1}", "--k", "0",
                                  "--metrics-port", str(free_port())], tmp_path)
        services += [verifier, target]
        wait_serving([verifier, target], 240)
        assert wait_drafter_connected(verifier.port, 120), verifier.log.read_text()[-2000:]
        yield drafter, verifier, target, metrics_port
    finally:
        stop(services)


def _counter(port: int, name: str) -> float:
    return sum(value for (sample, _), value in _scrape(port).items() if sample == name)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in lengths]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_drafter_process_queued_behind_the_sampler_gives_target_only_greedy_output(tmp_path):
    """With --queue-drafts on, the drafter maps the verifier's sampler output and waits on its GPU for the
    verifier's number, and returns its drafts into the verifier's memory, where the next verification reads
    them behind the drafter's number (the CUDA side the CPU tests above swap out). Greedy output must equal a
    target-only verifier's, and the verifier must have queued drafts, read them on its GPU and launched
    rounds before the last one's tokens were back (Scheduler._launch_ahead)."""
    with _queued_processes(tmp_path) as (_, verifier, target, metrics_port):
        prompts = _prompts((5, 17, 40, 9))
        assert _greedy_outputs(verifier.port, prompts, 48) == _greedy_outputs(target.port, prompts, 48)
        assert _counter(metrics_port, "specwire_queued_drafts_total") > 0, verifier.log.read_text()[-2000:]
        assert _counter(metrics_port, "specwire_queued_drafts_read_on_device_total") > 0
        assert _counter(metrics_port, "specwire_verifications_launched_ahead_total") > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("forced_hit_rate", [None, "1.0"], ids=["lookups", "forced_hits"])
def test_tables_ahead_in_a_drafter_process_give_target_only_greedy_output(tmp_path, forced_hit_rate):
    """--queued-tables: the drafter process drafts a table while each verification runs and looks it up on
    its GPU from the next sampler's output; where every request hit, its GPU copies the tables' drafts into
    the verifier's memory and writes the number at once (publish_if, decided on the GPU), and the serial
    drafts that follow write the same ids again. Greedy output must equal a target-only verifier's; the
    lookups are counted, and with hits forced at rate 1 (the random head's own never come) rounds are
    served by the tables."""
    args = ["--queued-tables", "8", *(["--forced-hit-rate", forced_hit_rate] if forced_hit_rate else [])]
    with _queued_processes(tmp_path, *args) as (_, verifier, target, metrics_port):
        prompts = _prompts((5, 17, 40, 9))
        assert _greedy_outputs(verifier.port, prompts, 48) == _greedy_outputs(target.port, prompts, 48)
        lookups = _counter(metrics_port, "specwire_spec_cache_lookups_total")
        served = _counter(metrics_port, "specwire_queued_tables_served_total")
        assert lookups > 0, verifier.log.read_text()[-2000:]
        if forced_hit_rate:
            assert served > 0, (lookups, served)
        assert _counter(metrics_port, "specwire_queued_drafts_read_on_device_total") > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_requests_arriving_while_drafts_are_read_on_the_gpu_give_target_only_greedy_output(tmp_path):
    """Requests arrive one after another while the earlier ones' drafts are read on the verifier's GPU: each
    new one sits a round out, then joins with its own step's drafts, uploaded beside those read on the GPU
    (_beside_device_drafts). Every request's greedy output must equal a target-only verifier's."""
    with _queued_processes(tmp_path) as (_, verifier, target, metrics_port):
        prompts = _prompts((5, 17, 40, 9, 23, 12))
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = []
            for prompt in prompts:
                streams.append(pool.submit(_greedy_outputs, verifier.port, [prompt], 160))
                time.sleep(0.03)
            outputs = [stream.result(timeout=120)[0] for stream in streams]
        assert outputs == _greedy_outputs(target.port, prompts, 160)
        for counter in ("queued_drafts_sat_out", "queued_drafts_read_on_device"):
            counter = f"specwire_{counter}_total"
            assert _counter(metrics_port, counter) > 0, (counter, verifier.log.read_text()[-2000:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_drafter_killed_while_the_verifier_reads_its_drafts_on_the_gpu_costs_no_request(tmp_path):
    """SIGKILL the drafter process while verifications read its drafts on the GPU: the verifier's GPU must not
    wait for a number that never comes, and every request must end with the target-only tokens."""
    with _queued_processes(tmp_path) as (drafter, verifier, target, metrics_port):
        prompts = _prompts((7, 30, 12))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            outputs = pool.submit(_greedy_outputs, verifier.port, prompts, 400)
            deadline = time.monotonic() + 120
            while _counter(metrics_port, "specwire_queued_drafts_read_on_device_total") < 20:
                assert time.monotonic() < deadline and not outputs.done(), verifier.log.read_text()[-2000:]
                time.sleep(0.005)
            drafter.process.kill()
            assert outputs.result(timeout=120) == _greedy_outputs(target.port, prompts, 400)
        assert verifier.process.poll() is None, "the verifier died with the drafter"
