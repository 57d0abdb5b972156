"""Load, churn and network faults on the two real gRPC services in-process (the tiny target and bigram head of
test_services_e2e), with a real TCP proxy (specwire.fault_proxy) between the verifier and the drafter:

- 256 concurrent streams finish with no error and target-only greedy output;
- a short soak of random arrivals, client cancels and deadlines loses and duplicates nothing, and leaves no
  KV slot taken on either service (bench/soak.py is the 10-minute version on the real model);
- the proxy stalls, slows and drops the verifier-drafter link under traffic: every request still gets
  target-only greedy output, and speculation resumes once the link heals.
"""

import asyncio
import time

import pytest
from test_services_e2e import (
    Drafter,
    Loop,
    Verifier,
    generate_all,
    greedy_reference,
    poll,
    prompts,
    tiny_target,
)

from specwire.default_model import default_model_path
from specwire.fault_proxy import FaultProxy
from specwire.soak import SoakConfig, problems, run_soak, tally
from specwire.tokenizer import load_tokenizer
from specwire.v1 import generation_pb2 as pb

STEP_TIMEOUT = 0.5  # seconds a verify step waits for drafts; the stall below lasts longer


@pytest.fixture(scope="module")
def world():
    loop = Loop()
    checkpoint = tiny_target()
    tokenizer = load_tokenizer(default_model_path())
    drafter = Drafter(loop, checkpoint, tokenizer.fingerprint)
    proxy = FaultProxy("127.0.0.1", drafter.port)
    loop.run(proxy.start())
    verifier = Verifier(loop, checkpoint, tokenizer, proxy.port, step_timeout=STEP_TIMEOUT, max_waiting=512)
    verifier.wait_connected()
    w = type("World", (), dict(loop=loop, checkpoint=checkpoint, drafter=drafter, proxy=proxy,
                               verifier=verifier))
    yield w
    verifier.close()
    loop.run(proxy.close())
    drafter.kill()
    loop.close()


def _fault(world, method, *args) -> None:
    """Switches the proxy from the test thread (its state belongs to the servers' event loop)."""
    world.loop.loop.call_soon_threadsafe(method, *args)


def _idle(world) -> None:
    """No request or KV slot left on either service (what every scenario must end with)."""
    v, d = world.verifier, world.drafter

    def state() -> dict:
        info = v.info()
        return {"running": info.num_running, "waiting": info.num_waiting, "free": info.free_slots,
                "kv_used": v.metrics.registry.get_sample_value("specwire_kv_slots", {"state": "used"}),
                "drafter_gauge": d.metrics.num_requests._value.get(), "drafter_known": d.num_requests()}

    def diagnosis() -> dict:  # the verifier's side of the drafter link, to explain state left on the drafter
        s = v.server.scheduler
        return {"frees_unsent": len(s._frees), "steps_unanswered": len(s.link._pending),
                "connected": s.link.connected}

    idle = {"running": 0, "waiting": 0, "free": v.info().max_slots, "kv_used": 0, "drafter_gauge": 0,
            "drafter_known": 0}
    deadline = time.time() + 30
    while (now := state()) != idle:
        assert time.time() < deadline, f"not idle after 30 s: {now}, {diagnosis()}"
        time.sleep(0.05)


def test_256_concurrent_streams_finish_with_no_error(world):
    batch = prompts(256, seed=31)
    results = generate_all(world.verifier, batch, max_tokens=8)
    expected = greedy_reference(world.checkpoint, batch, 8)
    errors = [c for _, _, c in results if not isinstance(c, pb.Complete)]
    assert not errors, errors[:3]
    assert [ids for ids, _, _ in results] == expected
    assert sum(c.usage.accepted_tokens for _, _, c in results) > 0  # speculation ran under the load
    _idle(world)


def _soak(world, config: SoakConfig, batch: list[list[int]]):
    future = asyncio.run_coroutine_threadsafe(
        run_soak(f"127.0.0.1:{world.verifier.port}", batch, config), world.loop.loop)
    return future


def test_short_soak_loses_nothing_and_frees_every_slot(world):
    batch = prompts(16, seed=32)
    config = SoakConfig(seconds=12, arrivals_per_second=25, max_in_flight=24, min_tokens=4, max_tokens=40,
                        cancel_fraction=0.2, deadline_fraction=0.2, seed=1)
    outcomes = _soak(world, config, batch).result(120)
    counts = tally(outcomes)
    assert problems(outcomes, greedy_reference(world.checkpoint, batch, 40)) == []
    # The churn really happened: requests were cancelled and cut by deadlines as well as completed.
    assert counts["ended_complete"] > 50 and counts["ended_cancelled"] > 0 and counts["ended_deadline"] > 0
    _idle(world)


def test_stalled_slow_and_dropped_link_keeps_output_exact_and_speculation_resumes(world):
    v, proxy = world.verifier, world.proxy
    m = v.metrics
    fallbacks_before = {r: v.counter(m.fallback_steps, reason=r) for r in ("timeout", "down")}
    connections_before = proxy.connections
    batch = prompts(12, seed=33)
    # Traffic outlasts the fault sequence below (about 6 s after speculation starts) even on a loaded machine.
    config = SoakConfig(seconds=12, arrivals_per_second=12, max_in_flight=8, min_tokens=20, max_tokens=60,
                        cancel_fraction=0, deadline_fraction=0, seed=2)
    running = _soak(world, config, batch)
    poll(lambda: m.num_accepted_tokens._value.get() > 0, what="speculation under traffic")
    time.sleep(1.0)
    _fault(world, proxy.stall)  # longer than the step timeout: steps go on without drafts
    time.sleep(4 * STEP_TIMEOUT)
    _fault(world, proxy.slow, 0.02)
    time.sleep(1.5)
    _fault(world, proxy.drop)  # the link breaks; the verifier reconnects through the proxy
    time.sleep(1.0)
    _fault(world, proxy.heal)
    outcomes = running.result(120)
    assert problems(outcomes, greedy_reference(world.checkpoint, batch, 60)) == []
    assert tally(outcomes)["ended_complete"] == len(outcomes) >= 8
    assert v.counter(m.fallback_steps, reason="timeout") > fallbacks_before["timeout"]
    assert proxy.connections > connections_before, "the verifier never reconnected after the drop"

    v.wait_connected()
    accepted = m.num_accepted_tokens._value.get()
    healed = prompts(4, seed=34)
    results = generate_all(v, healed, max_tokens=30)
    assert [ids for ids, _, _ in results] == greedy_reference(world.checkpoint, healed, 30)
    assert m.num_accepted_tokens._value.get() > accepted, "speculation did not resume once the link healed"
    _idle(world)


def test_the_soak_check_catches_loss_duplication_and_errors():
    """problems() is not vacuous: each kind of damage it exists for is reported."""
    from specwire.soak import Outcome

    ref = [[5, 6, 7, 8]]
    good = Outcome("a", 0, 4, "complete", "complete", [5, 6, 7, 8], pb.FINISH_REASON_LENGTH, 4)
    assert problems([good], ref) == []
    damaged = [
        Outcome("b", 0, 4, "complete", "complete", [5, 6, 6, 7], pb.FINISH_REASON_LENGTH, 4),  # duplicated
        Outcome("c", 0, 4, "complete", "complete", [5, 6, 7], pb.FINISH_REASON_LENGTH, 4),  # one lost
        Outcome("d", 0, 4, "cancel", "", [5]),  # never ended
        Outcome("e", 0, 4, "complete", "error", [], detail="13: boom"),
        Outcome("a", 0, 4, "deadline", "deadline", [5], foreign_ids=1),  # id reused, foreign response
    ]
    found = problems([good, *damaged], ref)
    assert found[0] == "a request id was used twice"
    for request_id in "bcde":
        assert any(line.startswith(f"{request_id} (") for line in found), (request_id, found)
    assert any("named another request" in line for line in found)


def test_undecodable_bytes_on_both_real_services_get_invalid_argument(world):
    """Junk on the verifier's Generate and on the drafter's internal Draft stream: INVALID_ARGUMENT, and
    both keep serving (the verifier's own Draft stream stays up, greedy output stays exact)."""
    import grpc

    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    junk = b"\xff\xff\xff\xff\x0f"
    codes = []
    for port, method, kind in ((world.verifier.port, "/specwire.v1.Generation/Generate", "unary_stream"),
                               (world.drafter.port, "/specwire.v1.Drafter/Draft", "stream_stream")):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = getattr(channel, kind)(method, **raw)
            for _ in range(5):
                try:
                    list(call(junk if kind == "unary_stream" else iter([junk]), timeout=10))
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 10
    assert world.verifier.info().speculation.drafter_connected
    batch = prompts(3, seed=35)
    results = generate_all(world.verifier, batch, max_tokens=12)
    assert [ids for ids, _, _ in results] == greedy_reference(world.checkpoint, batch, 12)
