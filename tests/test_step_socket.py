"""The Draft stream over the step socket (specwire.step_socket): the same exact output as over gRPC, the
framing's checks, and garbage from either end refused with the services still up.

The servers are the real ones of test_services_e2e (gRPC on 127.0.0.1 for the handshake, a Unix socket in a
temporary directory for the steps), with its tiny target and bigram head.
"""

import asyncio
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest
from specwire.drafter.server import DrafterService
from test_services_e2e import (
    Drafter,
    Loop,
    Verifier,
    generate_all,
    greedy_reference,
    poll,
    prompts,
    seeded_reference,
    tiny_target,
)

from specwire.cli import main
from specwire.default_model import default_model_path
from specwire.step_socket import FrameError, MessageSocket, serve
from specwire.tokenizer import load_tokenizer
from specwire.v1 import drafter_pb2 as dpb

MAX_BYTES = 1 << 16


class StreamRecordingDrafter(DrafterService):
    """A real drafter that notes which transport each Draft stream came over."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams: list[str] = []

    async def Draft(self, request_iterator, context):
        self.streams.append("grpc")
        await super().Draft(request_iterator, context)

    async def serve_socket(self, reader, writer):
        self.streams.append("socket")
        await super().serve_socket(reader, writer)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    loop = Loop()
    checkpoint = tiny_target()
    tokenizer = load_tokenizer(default_model_path())
    path = str(tmp_path_factory.mktemp("sockets") / "drafter.sock")
    drafter = Drafter(loop, checkpoint, tokenizer.fingerprint, service_class=StreamRecordingDrafter,
                      step_socket=path)
    verifier = Verifier(loop, checkpoint, tokenizer, drafter.port, drafter_socket=path)
    verifier.wait_connected()
    w = type("World", (), dict(loop=loop, checkpoint=checkpoint, tokenizer=tokenizer, drafter=drafter,
                               verifier=verifier, path=path))
    yield w
    w.verifier.close()
    w.drafter.kill()
    loop.close()


def token_ids(v: Verifier, batch: list[list[int]], **sampling) -> list[list[int]]:
    return [ids for ids, _, _ in generate_all(v, batch, **sampling)]


def test_output_over_the_socket_equals_target_only_greedy_and_seeded(world):
    v = world.verifier
    greedy = prompts(6, seed=41)
    assert token_ids(v, greedy, max_tokens=20) == greedy_reference(world.checkpoint, greedy, 20)
    sampled = prompts(4, seed=42)
    sampling = {"temperature": 0.3, "top_p": 0.9, "seed": 777}
    assert (token_ids(v, sampled, max_tokens=16, **sampling)
            == seeded_reference(world.checkpoint, sampled, 16, 0.3, 0.9, 777))
    assert v.counter(v.metrics.num_accepted_tokens) > 0  # drafts came and were verified
    assert world.drafter.service.streams == ["socket"], "the Draft stream did not go over the socket"
    assert stat.S_IMODE(os.stat(world.path).st_mode) == 0o600


def test_a_drafter_killed_mid_generation_over_the_socket_costs_no_request(world, tmp_path):
    path = str(tmp_path / "dying.sock")
    drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint, step_socket=path)
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, drafter.port, drafter_socket=path,
                 step_timeout=2.0)
    try:
        v.wait_connected()
        batch = prompts(4, seed=46)
        with ThreadPoolExecutor(len(batch)) as pool:
            futures = [pool.submit(v.generate, p, max_tokens=60) for p in batch]
            poll(lambda: v.counter(v.metrics.num_draft_tokens) > 0, what="speculation to start")
            drafter.kill()
            results = [f.result() for f in futures]
        assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 60)
        assert not v.info().speculation.drafter_connected
        assert v.counter(v.metrics.fallback_steps, reason="down") > 0
    finally:
        v.close()


def test_a_drafter_without_the_socket_costs_speculation_only(world, tmp_path):
    """A wrong --drafter-socket: the link names the path and retries; requests decode without drafts."""
    missing = str(tmp_path / "nobody.sock")
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, world.drafter.port, drafter_socket=missing)
    try:
        poll(lambda: missing in v.server.scheduler.link.last_error, what="the socket error")
        assert not v.info().speculation.drafter_connected
        batch = prompts(2, seed=43)
        assert token_ids(v, batch, max_tokens=8) == greedy_reference(world.checkpoint, batch, 8)
    finally:
        v.close()


class OtherHeadDrafter(DrafterService):
    """A real drafter that names another head: what a verifier pointed at the wrong socket would meet."""

    def load(self, *args, **kwargs) -> None:
        super().load(*args, **kwargs)
        self.info.head = "eagle1:another"


def test_the_socket_of_another_drafter_is_refused_with_both_named(world, tmp_path, caplog):
    path = str(tmp_path / "other.sock")
    other = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint, service_class=OtherHeadDrafter,
                    step_socket=path)
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, world.drafter.port, drafter_socket=path)
    try:
        poll(lambda: "belongs to another drafter" in v.server.scheduler.link.last_error, what="the refusal")
        error = v.server.scheduler.link.last_error
        assert path in error and "'eagle1:another'" in error and "'eagle1:bigram'" in error
        assert not v.info().speculation.drafter_connected
        batch = prompts(2, seed=47)
        assert token_ids(v, batch, max_tokens=8) == greedy_reference(world.checkpoint, batch, 8)
        assert v.counter(v.metrics.num_draft_tokens) == 0
    finally:
        v.close()
        other.kill()


def frame(message) -> bytes:
    """A message as the step socket carries it: its length, then its bytes."""
    data = message.SerializeToString()
    return len(data).to_bytes(4, "little") + data


UNDECODABLE = b"\x05\x00\x00\x00\xff\xff\xff\xff\xff"
OVERSIZED = (1 << 30).to_bytes(4, "little")


async def _garbage_server(path: str, hello: bytes, reply: bytes) -> asyncio.Server:
    """A socket that sends `hello` to every connection at once and `reply` once the verifier has written."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(hello)
        await reader.read(1)
        writer.write(reply)
        await reader.read()  # until the verifier hangs up
        writer.close()
    return await serve(path, answer)


@pytest.mark.parametrize(("first", "reply", "named"), [
    ("info", UNDECODABLE, "DraftResult"), ("info", OVERSIZED, "DraftResult"),
    ("garbage", b"", "DrafterInfo")], ids=["undecodable_result", "oversized_result", "undecodable_hello"])
def test_garbage_from_the_socket_is_refused_counted_and_falls_back(world, tmp_path, first, reply, named,
                                                                    caplog):
    path = str(tmp_path / "garbage.sock")
    hello = frame(world.drafter.service.info) if first == "info" else UNDECODABLE
    garbage = world.loop.run(_garbage_server(path, hello, reply))
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, world.drafter.port, drafter_socket=path,
                 step_timeout=0.5, table_wait=0.2, just_in_time_wait=0.2)
    try:
        if first == "info":  # steps go out once it is up: requests that finished before it would send none
            v.wait_connected()
        batch = prompts(3, seed=44)
        assert token_ids(v, batch, max_tokens=10) == greedy_reference(world.checkpoint, batch, 10)
        poll(lambda: v.counter(v.metrics.bad_payloads, reason="link_error") > 0, what="the refusal")
        reasons = [getattr(r, "reason", "") for r in caplog.records if r.getMessage() == "drafter link error"]
        assert any(named in reason for reason in reasons), reasons
        assert v.counter(v.metrics.num_draft_tokens) == 0
    finally:
        v.close()
        garbage.close()


def test_garbage_into_the_drafters_socket_ends_that_stream_only(world):
    d = world.drafter

    async def send_garbage() -> bytes:
        reader, writer = await asyncio.open_unix_connection(world.path)
        writer.write(OVERSIZED)
        answer = await reader.read()  # the drafter says who it is, then hangs up
        writer.close()
        return answer

    before = d.metrics.bad_payloads.labels(reason="link_error")._value.get()
    assert world.loop.run(send_garbage(), timeout=10) == frame(d.service.info)
    poll(lambda: d.metrics.bad_payloads.labels(reason="link_error")._value.get() > before, what="the count")
    batch = prompts(2, seed=45)  # the verifier's own stream is untouched
    assert (token_ids(world.verifier, batch, max_tokens=12)
            == greedy_reference(world.checkpoint, batch, 12))


def test_message_socket_frames_and_refusals(tmp_path):
    path = str(tmp_path / "echo.sock")

    async def exchange() -> None:
        async def echo(reader, writer):
            messages = MessageSocket(reader, writer, dpb.DraftStep, MAX_BYTES)
            while (step := await messages.read()) is not None:
                await messages.write(dpb.DraftResult(step_id=step.step_id, error=str(len(step.wants))))
            messages.close()

        server = await serve(path, echo)
        link = await MessageSocket.connect(path, dpb.DraftResult, MAX_BYTES)
        for i in range(1, 50):  # written at once (write_now, as the verifier's link does when nothing waits)
            step = dpb.DraftStep(step_id=i, wants=[dpb.DraftWant(request_id=str(j)) for j in range(i % 5)])
            if i % 2:
                link.write_now(step)
            else:
                await link.write(step)
        answers = [await link.read() for _ in range(1, 50)]
        assert [(a.step_id, a.error) for a in answers] == [(i, str(i % 5)) for i in range(1, 50)]
        with pytest.raises(FrameError, match="over the 65536-byte limit"):
            await link.write(dpb.DraftStep(updates=[dpb.RequestUpdate(request_id="x" * MAX_BYTES)]))
        with pytest.raises(FrameError, match="over the 65536-byte limit"):
            link.write_now(dpb.DraftStep(updates=[dpb.RequestUpdate(request_id="x" * MAX_BYTES)]))
        link.close()
        with pytest.raises(ConnectionResetError, match="the step socket is closed"):
            await link.write(dpb.DraftStep(step_id=1))
        server.close()

        async def cut_short(reader, writer):
            writer.write(b"\x10\x00\x00\x00\x08")  # a 16-byte message, 1 byte of it
            writer.close()
        server = await serve(path, cut_short)
        link = await MessageSocket.connect(path, dpb.DraftResult, MAX_BYTES)
        with pytest.raises(FrameError, match="ended 1 bytes into a 16-byte message"):
            await link.read()
        server.close()

    asyncio.run(exchange())


def test_the_verifier_refuses_a_socket_without_a_drafter(capsys):
    argv = ["verifier", "--model", "synthetic:tiny", "--device", "cpu", "--listen", "127.0.0.1:0",
            "--drafter-socket", "/tmp/drafter.sock"]
    assert main(argv) == 2
    assert "--drafter-socket needs --drafter HOST:PORT" in capsys.readouterr().err


def test_the_drafter_names_a_socket_path_it_cannot_listen_on(capsys, tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a socket")
    argv = ["drafter", "--model", "synthetic:tiny", "--device", "cpu", "--listen", "127.0.0.1:0",
            "--step-socket", str(taken)]
    assert main(argv) != 0
    assert f"cannot listen on the step socket {taken}" in capsys.readouterr().err
