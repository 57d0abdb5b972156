"""Release review of the two services: faults of the drafter that must cost speed only, never a request
or the drafter link. Real servers in-process, the tiny target and bigram head of test_services_e2e."""

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from specwire.drafter.proposer import EagleProposer
from specwire.drafter.server import DrafterService
from test_services_e2e import (
    MAX_CONTEXT,
    Drafter,
    K,
    Loop,
    Verifier,
    generate_all,
    greedy_reference,
    poll,
    prompts,
    tiny_target,
)

from specwire.default_model import default_model_path
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import load_tokenizer
from specwire.v1 import drafter_pb2 as dpb
from specwire.v1 import drafter_pb2_grpc
from specwire.v1 import generation_pb2 as pb
from specwire.wire import encode_tensor

UNKNOWN_ENUM = 99  # a value no ProbsKind / DType names: what a newer or broken drafter may send


@pytest.fixture(scope="module")
def world():
    loop = Loop()
    w = type("World", (), dict(loop=loop, checkpoint=tiny_target(),
                               tokenizer=load_tokenizer(default_model_path())))
    yield w
    loop.close()


def serve(world, service_class, **verifier_args) -> tuple[Drafter, Verifier]:
    drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint, service_class=service_class)
    return drafter, Verifier(world.loop, world.checkpoint, world.tokenizer, drafter.port, **verifier_args)


class UnknownProbsKindDrafter(DrafterService):
    """Labels every proposal with a probs_kind the enum does not name."""

    def run_step(self, stream, owned, step, features=None, draft=True):
        result = super().run_step(stream, owned, step, features, draft)
        for proposal in result.proposals:
            proposal.probs_kind = UNKNOWN_ENUM
        return result


def test_unknown_probs_kind_is_a_bad_payload_not_a_failed_request(world):
    drafter, v = serve(world, UnknownProbsKindDrafter)
    try:
        v.wait_connected()
        batch = prompts(4, seed=21)
        results = generate_all(v, batch, max_tokens=16)
        for (ids, _, end), want in zip(results, greedy_reference(world.checkpoint, batch, 16), strict=True):
            assert isinstance(end, pb.Complete), f"request failed: {end}"
            assert ids == want
        assert v.counter(v.metrics.bad_payloads, reason="bad_tensor") > 0
        assert v.counter(v.metrics.num_draft_tokens) == 0
    finally:
        v.close()
        drafter.kill()


class UnknownFeatureDtypeDrafter(DrafterService):
    """Asks for features in a dtype the verifier's enum does not name."""

    def load(self, *args):
        super().load(*args)
        self.info.feature_dtype = UNKNOWN_ENUM


def test_unknown_feature_dtype_is_refused_and_the_link_keeps_retrying(world):
    drafter, v = serve(world, UnknownFeatureDtypeDrafter)
    try:
        link = v.server.scheduler.link
        poll(lambda: "feature" in link.last_error or link._task.done(), what="the refusal")
        assert not link._task.done(), "the reconnect loop died"
        assert str(UNKNOWN_ENUM) in link.last_error
        assert not v.info().speculation.drafter_connected
        assert v.generate([4, 5, 6], max_tokens=8)[0] == greedy_reference(world.checkpoint, [[4, 5, 6]], 8)[0]
    finally:
        v.close()
        drafter.kill()


class TwoSlotDrafter(DrafterService):
    """A real drafter whose proposer holds at most 2 requests (DrafterInfo.max_requests = 2)."""

    def load(self, proposer, *args):
        small = EagleProposer(proposer.head, max_requests=2, max_context=MAX_CONTEXT, max_drafts=K,
                              max_top_k=16, max_branches=proposer.max_branches)
        super().load(small, *args)


def test_verifier_sends_the_drafter_no_more_requests_than_it_holds(world):
    drafter, v = serve(world, TwoSlotDrafter)
    try:
        v.wait_connected()
        batch = prompts(6, seed=22)
        results = generate_all(v, batch, max_tokens=24)
        assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 24)
        # Past max_requests the drafter refuses each NewRequest; the verifier then re-sent the whole request
        # (all its prompt features) at every step, to be refused again.
        refused = drafter.metrics.bad_payloads.labels(reason="unknown_request")._value.get()
        assert refused == 0, f"the drafter refused {refused:.0f} updates"
        assert v.counter(v.metrics.num_accepted_tokens) > 0
    finally:
        v.close()
        drafter.kill()


def test_a_request_gets_a_drafter_slot_once_one_frees_up(world):
    drafter, v = serve(world, TwoSlotDrafter)
    try:
        v.wait_connected()
        short, late = prompts(2, seed=23), prompts(1, seed=24)[0]
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(v.generate, p, max_tokens=6) for p in short]
            ids, _, complete = v.generate(late, max_tokens=60)
            assert all(isinstance(f.result()[2], pb.Complete) for f in first)
        assert ids == greedy_reference(world.checkpoint, [late], 60)[0]
        assert complete.usage.draft_tokens > 0
    finally:
        v.close()
        drafter.kill()


def test_abort_during_prefill_streams_nothing_more(world):
    """The Abort RPC wins over a step already running: as in verify, prefill must not stream its token."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, None)
    s = v.server.scheduler

    async def abort_while_prefilling():
        r = s.submit(prompts(1, seed=26)[0] * 6, SamplingParams(max_tokens=1))
        while r not in s.running:  # joined the batch: its prefill is on the worker now
            await asyncio.sleep(0)
        assert r.num_output == 0 and s.abort(r.id)
        outputs = [await r.outputs.get()]
        while outputs[-1].finish_reason is None:
            outputs.append(await r.outputs.get())
        return outputs

    try:
        outputs = v.loop.run(abort_while_prefilling())
        assert [o.token_ids for o in outputs] == [[]]
        assert outputs[-1].finish_reason == "abort"
    finally:
        v.close()


class FailsOnce:
    """Wraps the verifier's real drafter check; its first call raises as a bug in a check would."""

    MESSAGE = "injected: a bug in the drafter check"

    def __init__(self, check):
        self.check, self.calls = check, 0

    def __call__(self, info):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError(self.MESSAGE)
        self.check(info)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unexpected_error_while_connecting_is_logged_and_the_link_retries(world, caplog):
    port = free_port()
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, port)  # no drafter there yet: nothing checked
    try:
        link = v.server.scheduler.link
        link.check_info = check = FailsOnce(link.check_info)
        drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint, port=port)
        try:
            poll(lambda: check.calls >= 2 or link._task.done(), what="a second handshake")
            assert not link._task.done(), "the reconnect loop died"
            v.wait_connected()
            errors = [r for r in caplog.records if r.getMessage() == "drafter link error"]
            assert [(r.error, r.reason) for r in errors] == [("RuntimeError", FailsOnce.MESSAGE)]
            assert v.counter(v.metrics.bad_payloads, reason="link_error") == 1
            batch = prompts(4, seed=27)
            results = generate_all(v, batch, max_tokens=20)
            assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 20)
            assert v.counter(v.metrics.num_draft_tokens) > 0, "speculation did not resume"
        finally:
            drafter.kill()
    finally:
        v.close()


def test_drafter_counts_the_drafts_it_sends_not_the_drafts_asked_for(world):
    drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint)
    try:
        F = drafter.service.info.feature_dim
        # Tokens held (prompt + first sampled token): the first request fills the drafter's context but one,
        # which leaves room to draft 2 of the K = 3 asked for.
        lengths = {"near-the-end": MAX_CONTEXT, "short": 8}
        updates = [dpb.RequestUpdate(request_id=rid, new_request=dpb.NewRequest(
            token_ids=list(range(3, 3 + n)), features=encode_tensor(torch.randn(n - 1, F))))
            for rid, n in lengths.items()]
        wants = [dpb.DraftWant(request_id=rid, num_drafts=K) for rid in lengths]
        with grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
            stream = drafter_pb2_grpc.DrafterStub(channel).Draft(
                iter([dpb.DraftStep(step_id=1, updates=updates, wants=wants)]), timeout=30)
            result = next(stream)
        assert not result.error and not result.dropped_request_ids
        sent = {p.request_id: len(p.draft_token_ids) for p in result.proposals}
        assert sent == {"near-the-end": 2, "short": K}
        assert drafter.metrics.draft_tokens._value.get() == sum(sent.values())
    finally:
        drafter.kill()
