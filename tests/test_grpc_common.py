"""specwire.grpc_common against real servers on 127.0.0.1: TLS and mTLS handshakes with certificates made
here, the bearer token, health transitions, reflection, message bounds, SIGTERM drain, logs and flags."""

import argparse
import asyncio
import datetime
import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from toy_generation import ToyGeneration, add_toy, expected_output

from specwire import grpc_common
from specwire.grpc_common import ChannelOptions, GrpcServer, ServerOptions
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PLAIN = ChannelOptions()


# ---------------------------------------------------------------- helpers


async def _started(options: ServerOptions, servicer: ToyGeneration | None = None, *, token_protected=False,
                   serving=True) -> GrpcServer:
    server = GrpcServer(options)
    add_toy(server, servicer or ToyGeneration(), require_token=token_protected)
    await server.start()
    if serving:
        await server.set_serving(True)
    return server


async def _model_info(port: int, channel_options: ChannelOptions = PLAIN, metadata=()) -> pb.ModelInfo:
    async with grpc_common.create_channel(f"127.0.0.1:{port}", channel_options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)


async def _health(port: int, service: str, channel_options: ChannelOptions = PLAIN) -> int:
    async with grpc_common.create_channel(f"127.0.0.1:{port}", channel_options) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
        return reply.status


async def _generate_text(stub, prompt: str, metadata=()) -> tuple[str, pb.Complete]:
    text, complete = "", None
    async for response in stub.Generate(pb.GenerateRequest(text=prompt), metadata=metadata, timeout=30):
        if response.WhichOneof("event") == "chunk":
            text += response.chunk.text
        else:
            complete = response.complete
    return text, complete


# ---------------------------------------------------------------- TLS


def test_tls_handshake_and_plaintext_client_refused(pki):
    async def body():
        cert, key = pki["server"]
        server = await _started(ServerOptions(tls_cert=cert, tls_key=key))
        try:
            info = await _model_info(server.port, ChannelOptions(tls_ca=pki["ca"][0]))
            assert info.model_name == "toy-bytes"
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await _model_info(server.port)
            assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
            # A client that trusts another CA refuses the server's certificate.
            with pytest.raises(grpc.aio.AioRpcError) as untrusted:
                await _model_info(server.port, ChannelOptions(tls_ca=pki["rogue_client"][0]))
            assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.drain(0)

    asyncio.run(body())


def test_mtls_requires_a_client_cert_from_the_trusted_ca(pki):
    async def body():
        cert, key = pki["server"]
        ca = pki["ca"][0]
        server = await _started(ServerOptions(tls_cert=cert, tls_key=key, tls_client_ca=ca))
        try:
            client_cert, client_key = pki["client"]
            info = await _model_info(server.port, ChannelOptions(tls_ca=ca, tls_cert=client_cert,
                                                                 tls_key=client_key))
            assert info.max_slots == 8
            for options in (ChannelOptions(tls_ca=ca),
                            ChannelOptions(tls_ca=ca, tls_cert=pki["rogue_client"][0],
                                           tls_key=pki["rogue_client"][1])):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _model_info(server.port, options)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.drain(0)

    asyncio.run(body())


def test_tls_options_are_validated(pki):
    with pytest.raises(ValueError, match="--tls-key"):
        ServerOptions(tls_cert=pki["server"][0])
    with pytest.raises(ValueError, match="mutual TLS"):
        ServerOptions(tls_client_ca=pki["ca"][0])
    with pytest.raises(ValueError, match="cannot read TLS file /nonexistent.pem"):
        grpc_common.channel_credentials("/nonexistent.pem")
    with pytest.raises(ValueError, match="both a cert and a key"):
        grpc_common.channel_credentials(pki["ca"][0], cert=pki["client"][0])


# ---------------------------------------------------------------- bearer token


def test_bearer_token_guards_generation_only():
    async def body():
        server = await _started(ServerOptions(token="s3cret"), token_protected=True)
        try:
            for metadata, needle in [((), "missing bearer token"),
                                     (grpc_common.auth_metadata("wrong"), "wrong bearer token")]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _model_info(server.port, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert needle in refused.value.details()
            async with grpc_common.create_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as stream_refused:
                    await _generate_text(stub, "hi")
                assert stream_refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                text, complete = await _generate_text(stub, "hi there", grpc_common.auth_metadata("s3cret"))
                assert text == expected_output("hi there").decode()
                assert complete.finish_reason == pb.FINISH_REASON_STOP
            # Health stays open for probes that carry no token.
            assert await _health(server.port, grpc_common.GENERATION_SERVICE) == SERVING
        finally:
            await server.drain(0)

    asyncio.run(body())


# ---------------------------------------------------------------- health, reflection, bounds


def test_health_transitions_and_drain_lets_inflight_streams_finish():
    async def body():
        servicer = ToyGeneration(seconds_per_chunk=0.05)
        server = await _started(ServerOptions(health_listen="127.0.0.1:0", grace_seconds=10), servicer,
                                serving=False)
        for port in (server.port, server.health_port):
            for service in ("", grpc_common.GENERATION_SERVICE):
                assert await _health(port, service) == NOT_SERVING
        await server.set_serving(True)
        assert await _health(server.health_port, "") == SERVING
        assert await _health(server.port, grpc_common.GENERATION_SERVICE) == SERVING

        async with grpc_common.create_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompt = "a stream that is still running when the drain starts"
            inflight = asyncio.create_task(_generate_text(stub, prompt))
            while not servicer.running:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(server.drain())
            await asyncio.sleep(0.1)
            assert server.draining.is_set()
            assert await _health(server.health_port, grpc_common.GENERATION_SERVICE) == NOT_SERVING
            await server.set_serving(True)  # ignored once draining
            assert await _health(server.health_port, "") == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError):
                await _model_info(server.port)
            text, complete = await inflight
            assert text == expected_output(prompt).decode()
            assert complete.finish_reason == pb.FINISH_REASON_STOP
            await drain

    asyncio.run(body())


def test_reflection_lists_the_services():
    async def body():
        server = await _started(ServerOptions())
        try:
            async with grpc_common.create_channel(f"127.0.0.1:{server.port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=10)]
            names = {s.name for s in replies[0].list_services_response.service}
            assert names == {"specwire.v1.Generation", "grpc.health.v1.Health",
                             "grpc.reflection.v1alpha.ServerReflection"}
        finally:
            await server.drain(0)

    asyncio.run(body())


def test_messages_over_the_bound_are_refused():
    async def body():
        bound = 64 * 1024
        server = await _started(ServerOptions(max_message_bytes=bound))
        try:
            async with grpc_common.create_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                text, _ = await _generate_text(stub, "x" * (bound // 2))
                assert len(text) == 64
                with pytest.raises(grpc.aio.AioRpcError) as too_big:
                    await _generate_text(stub, "x" * (bound + 1))
                assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.drain(0)

    asyncio.run(body())


def test_sigterm_drains_a_real_process():
    """The signal path end to end: SIGTERM mid-stream, the stream still completes, the process exits 0."""
    tests_dir = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{tests_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(tests_dir / "toy_generation.py"), "0.05", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port, health_port = map(int, proc.stdout.readline().split())

        async def body():
            async with grpc_common.create_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                prompt = "sigterm arrives while this is streaming"
                inflight = asyncio.create_task(_generate_text(stub, prompt))
                await asyncio.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                assert await _health(health_port, "") == NOT_SERVING
                text, complete = await inflight
                assert text == expected_output(prompt).decode()

        asyncio.run(body())
        assert proc.wait(timeout=20) == 0
        lines = (json.loads(line) for line in proc.stderr.read().splitlines())
        logs = [entry for entry in lines if entry["logger"] == "specwire.grpc"]
        frozen = "start-up objects frozen out of the garbage collector"
        assert [entry["msg"] for entry in logs] == ["listening", frozen, "signal", "draining", "stopped"]
        assert logs[1]["objects"] > 10_000  # grpc, protobuf and the rest of the imports at least
        assert logs[2]["signal"] == "SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- logging and flags


def test_json_logs_one_object_per_line_with_extra_fields():
    stream = io.StringIO()
    grpc_common.setup_logging("DEBUG", "json", stream)
    try:
        logging.getLogger("specwire.test").info("step done", extra={"step_id": 7, "rows": [1, 2]})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("specwire.test").exception("failed")
    finally:
        logging.getLogger().handlers.clear()
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "step done" and first["level"] == "INFO" and first["logger"] == "specwire.test"
    assert first["step_id"] == 7 and first["rows"] == [1, 2]
    assert datetime.datetime.fromisoformat(first["ts"]).tzinfo is not None
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc"]
    with pytest.raises(ValueError, match="'xml'"):
        grpc_common.setup_logging("INFO", "xml")


def test_logs_without_a_stream_go_to_the_stderr_of_the_moment(monkeypatch):
    """A server's threads log after whoever set logging up has swapped stderr back (a test's capture, closed
    when the test ends): each record goes to the stderr of its moment, never to a closed stream."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    grpc_common.setup_logging("INFO", "text")
    try:
        logging.getLogger("specwire.test").info("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("specwire.test").info("two")
    finally:
        logging.getLogger().handlers.clear()
    assert second.getvalue().splitlines()[-1].endswith("INFO specwire.test: two")


def test_text_logs_keep_the_extra_fields():
    stream = io.StringIO()
    grpc_common.setup_logging("INFO", "text", stream)
    try:
        logging.getLogger("specwire.test").warning("drafter disconnected", extra={"reason": "write failed"})
        logging.getLogger("specwire.test").info("plain")
    finally:
        logging.getLogger().handlers.clear()
    first, second = stream.getvalue().splitlines()
    assert first.endswith("WARNING specwire.test: drafter disconnected reason='write failed'")
    assert second.endswith("INFO specwire.test: plain")


def test_env_default_parses_like_the_default(monkeypatch):
    monkeypatch.setenv("SPECWIRE_T_INT", "7")
    monkeypatch.setenv("SPECWIRE_T_BOOL", "off")
    monkeypatch.setenv("SPECWIRE_T_FLOAT", "2.5")
    monkeypatch.setenv("SPECWIRE_T_BAD", "seven")
    assert grpc_common.env_default("SPECWIRE_T_INT", 1) == 7
    assert grpc_common.env_default("SPECWIRE_T_BOOL", True) is False
    assert grpc_common.env_default("SPECWIRE_T_FLOAT", 1.0) == 2.5
    assert grpc_common.env_default("SPECWIRE_T_UNSET", "dflt") == "dflt"
    with pytest.raises(ValueError, match="SPECWIRE_T_BAD='seven' is not a valid int"):
        grpc_common.env_default("SPECWIRE_T_BAD", 3)
    with pytest.raises(ValueError, match="not a boolean"):
        grpc_common.env_default("SPECWIRE_T_BAD", False)


def test_flags_build_options_from_args_and_env(monkeypatch, pki):
    monkeypatch.setenv("SPECWIRE_MAX_MESSAGE_MB", "8")
    monkeypatch.setenv("SPECWIRE_DRAFTER_TLS_CA", pki["ca"][0])
    parser = argparse.ArgumentParser()
    grpc_common.add_server_arguments(parser, default_listen="0.0.0.0:50051")
    grpc_common.add_channel_arguments(parser, prefix="drafter-")
    args = parser.parse_args(["--token", "t", "--grace-seconds", "3"])
    server = ServerOptions.from_args(args)
    assert (server.listen, server.max_message_bytes, server.token, server.grace_seconds) == \
        ("0.0.0.0:50051", 8 * 1024 * 1024, "t", 3.0)
    channel = ChannelOptions.from_args(args, prefix="drafter-")
    assert channel.tls and channel.tls_ca == pki["ca"][0] and channel.tls_cert is None


def test_the_verifier_bounds_its_drafter_channel_by_its_max_message_flag(monkeypatch, pki):
    """--max-message-mb is the verifier's bound on every message, its steps to the drafter included (they
    carry new prompts' features): the channel used to keep gRPC's 64 MiB whatever the flag said."""
    from specwire.verifier.cli import drafter_channel

    from specwire.cli import build_parser

    monkeypatch.setenv("SPECWIRE_DRAFTER_TLS_CA", pki["ca"][0])
    args = build_parser("verifier").parse_args(["verifier", "--max-message-mb", "256"])
    channel = drafter_channel(args, ServerOptions.from_args(args))
    assert channel.max_message_bytes == 256 * 1024 * 1024 and channel.tls_ca == pki["ca"][0]


def test_a_queue_drafts_value_from_the_environment_is_checked_as_the_flag_is(monkeypatch, capsys):
    """argparse checks --queue-drafts against its choices but not a default taken from SPECWIRE_QUEUE_DRAFTS:
    a typo there must stop the verifier with one line, not fall back to auto unseen."""
    from specwire.cli import main

    monkeypatch.setenv("SPECWIRE_QUEUE_DRAFTS", "yes")
    assert main(["verifier", "--listen", "127.0.0.1:0", "--k", "0", "--device", "cpu"]) != 0
    want = "specwire: error: --queue-drafts must be auto, on or off, got 'yes'"
    assert capsys.readouterr().err.strip() == want


def test_run_sets_the_switch_interval_for_the_service_and_refuses_nonsense():
    """A service's event loop runs under the --switch-interval it was given (the model thread's wait for the
    GIL after a device wait is bounded by it); zero, negative and absurd values are refused up front."""
    default = sys.getswitchinterval()

    async def seen() -> float:
        return sys.getswitchinterval()

    try:
        assert grpc_common.run(seen(), switch_interval=2e-4) == pytest.approx(2e-4)
    finally:
        sys.setswitchinterval(default)
    for bad in (0.0, -1e-3, 5.0):
        with pytest.raises(ValueError, match="--switch-interval"):
            grpc_common.run(seen(), switch_interval=bad)
    parser = argparse.ArgumentParser()
    grpc_common.add_server_arguments(parser, default_listen="127.0.0.1:0")
    assert parser.parse_args([]).switch_interval == grpc_common.DEFAULT_SWITCH_INTERVAL
    assert parser.parse_args(["--switch-interval", "0.001"]).switch_interval == 0.001
