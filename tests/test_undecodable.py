"""Undecodable request messages against a real grpc.aio server on 127.0.0.1 (specwire.undecodable): each call
ends INVALID_ARGUMENT, the log gets one warning line per interval and no traceback, and the server keeps
serving. Covers a unary-stream (Generate), a unary-unary (Abort) and a bidirectional stream (reflection)."""

import asyncio
import logging

import grpc
from toy_generation import ToyGeneration, add_toy, expected_output

from specwire import grpc_common
from specwire.grpc_common import GrpcServer, ServerOptions
from specwire.undecodable import RateLimitedWarning
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

JUNK = b"\xff\xff\xff\xff\x0f"  # a field with wire type 7: no protobuf parser accepts it
CALLS_PER_METHOD = 40
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


async def _junk_calls(port: int) -> list[grpc.StatusCode]:
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    codes = []
    async with grpc_common.create_channel(f"127.0.0.1:{port}") as channel:
        generate = channel.unary_stream("/specwire.v1.Generation/Generate", **raw)
        abort = channel.unary_unary("/specwire.v1.Generation/Abort", **raw)
        reflect = channel.stream_stream(REFLECTION, **raw)
        for _ in range(CALLS_PER_METHOD):
            for call in (lambda: _drain(generate(JUNK)), lambda: abort(JUNK),
                         lambda: _drain(reflect(iter([JUNK])))):
                try:
                    await call()
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    return codes


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_undecodable_messages_get_invalid_argument_and_one_warning(caplog):
    async def body():
        server = GrpcServer(ServerOptions())
        add_toy(server, ToyGeneration())
        await server.start()
        await server.set_serving(True)
        try:
            codes = await _junk_calls(server.port)
            async with grpc_common.create_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                text = ""
                async for response in stub.Generate(pb.GenerateRequest(text="still fine")):
                    text += response.chunk.text
            return codes, text, server.undecodable.count
        finally:
            await server.drain(0)

    with caplog.at_level(logging.INFO):
        codes, text, count = asyncio.run(body())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * (3 * CALLS_PER_METHOD)
    assert count == 3 * CALLS_PER_METHOD
    assert text == expected_output("still fine").decode()  # nothing else was disturbed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    # One line for the whole burst (the interval is 10 s), and no traceback from grpc's own handler.
    assert [r.getMessage() for r in warnings] == ["undecodable request message"]
    assert all(r.exc_info is None for r in caplog.records)
    assert warnings[0].method.startswith("/specwire.v1.Generation/")


def test_rate_limited_warning_counts_what_it_held_back(caplog, monkeypatch):
    clock = [0.0]
    warn = RateLimitedWarning(logging.getLogger("specwire.test"), interval=5.0)
    monkeypatch.setattr("specwire.undecodable.time.monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="specwire.test"):
        logged = []
        for t in (0.0, 1.0, 2.0, 4.9, 5.0, 5.1, 11.0):
            clock[0] = t
            logged.append(warn("bad"))
    assert logged == [True, False, False, False, True, False, True]
    assert [r.suppressed_since_last for r in caplog.records] == [0, 3, 1]
