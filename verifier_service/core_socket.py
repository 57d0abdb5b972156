"""The core's end of a verifier split in two processes (`specwire verifier --frontend process`).

A co-located or batched verifier's loop spent about a third of its CPU on the client streams (57 us a request
a round on the 2-core CPU, bench/results/session35/stream_share_cpu.txt): a queue hand-off, a response message
and a grpc.aio write per request per round, all on the thread that launches the verifications. Split as vLLM's
V1 is, the front-end process (frontend.py) owns the gRPC Generation service and its streams, and this process
keeps the engine, the scheduler and the drafter link. Between them, an owner-only Unix socket with
specwire.step_socket's framing and bounds: CoreCall messages in, and out one CoreEvents per turn of the
scheduler's loop holding every stream's responses. The front-end also turns token ids into text (the core
sends it the tokenizer first), but for requests with stop strings, whose text the core needs to stop them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable

from specwire.verifier.drafter_link import LocalDrafterLink
from specwire.verifier.request_error import RequestError, error_response, in_flight_already
from specwire.verifier.scheduler import Output, Request, Scheduler
from specwire.verifier.server import (
    VerifierSettings,
    complete,
    model_info,
    parse_request,
    rejected,
    start_scheduler,
)

from specwire import grpc_common, step_socket
from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.tokenizer import Tokenizer
from specwire.v1 import frontend_pb2 as fpb
from specwire.v1 import generation_pb2 as pb

log = logging.getLogger("specwire.verifier.core")

# Bytes a front-end may leave unread before it counts as gone: a round's message is a few kB, so this is
# thousands of rounds behind (its requests are then aborted rather than buffered without bound).
MAX_UNREAD_BYTES = 64 << 20


class _Stream:
    """A request's outputs, bound for its front-end's next CoreEvents."""

    __slots__ = ("connection", "request_id", "request")

    def __init__(self, connection: FrontendConnection, request_id: str):
        self.connection, self.request_id = connection, request_id
        self.request: Request | None = None  # once submitted

    def put_nowait(self, out: Output, /) -> None:
        self.connection.emit(self, out)


class FrontendConnection:
    """One front-end: its calls in; its streams' responses out, gathered into one message per loop turn."""

    def __init__(self, socket: step_socket.MessageSocket, scheduler: Scheduler, metrics: VerifierMetrics,
                 model_name: str):
        self.socket, self.scheduler, self.metrics, self.model_name = socket, scheduler, metrics, model_name
        self.streams: dict[str, _Stream] = {}  # requests it submitted that have not ended
        self._events = fpb.CoreEvents()  # this turn's, sent by _flush
        self._finished: list[_Stream] = []  # requests whose Complete goes last in this turn's message
        self._flush_due = False

    async def serve(self) -> None:
        """Sends the tokenizer, then takes the front-end's calls until it leaves; then its requests are
        aborted."""
        self._send(fpb.CoreEvents(tokenizer=self.scheduler.tokenizer.backend.to_str()))
        try:
            while (call := await self.socket.read()) is not None:
                self._take(call)
        except (step_socket.FrameError, ConnectionError) as e:
            log.warning("front-end connection broken", extra={"error": str(e)})
        finally:
            self._close()

    def _take(self, call: fpb.CoreCall) -> None:
        kind = call.WhichOneof("call")
        if kind == "submit":
            self._submit(call.submit)
        elif kind == "abort":
            if call.abort.request_id in self.streams:
                self.scheduler.abort(call.abort.request_id, cancelled=call.abort.cancelled)
        elif kind == "model_info":
            answer = fpb.CoreEvents(model_info=model_info(self.scheduler, self.model_name),
                                    model_info_nonce=call.model_info)
            self._send(answer)
        else:
            log.warning("front-end call of no known kind: ignored")

    def _submit(self, request: pb.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            if not request_id:
                raise RequestError(pb.ERROR_CODE_INVALID_ARGUMENT, "the front-end sent no request_id")
            if request_id in self.streams:
                raise in_flight_already(request_id)
            prompt, params = parse_request(self.scheduler, request)
            stream = _Stream(self, request_id)
            stream.request = self.scheduler.submit(prompt, params, request_id, outputs=stream, text=False)
        except RequestError as e:
            self._events.responses.append(rejected(self.metrics, request_id, e))
            self._flush_soon()
            return
        self.streams[request_id] = stream

    def emit(self, stream: _Stream, out: Output) -> None:
        """An output of one of its requests (from the scheduler's loop): it joins this turn's message. A
        Complete is made when the message goes, after the loop has counted the round's drafts."""
        request_id = stream.request_id
        if out.token_ids or out.text:
            chunk = self._events.responses.add(request_id=request_id).chunk
            chunk.token_ids.extend(out.token_ids)
            chunk.text = out.text
        if out.finish_reason == "error":
            failed = RequestError(pb.ERROR_CODE_INTERNAL, out.error)
            self._events.responses.append(error_response(request_id, failed))
            self.streams.pop(request_id, None)
        elif out.finish_reason is not None:
            self._finished.append(stream)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        events, self._events = self._events, fpb.CoreEvents()
        for stream in self._finished:
            self.streams.pop(stream.request_id, None)
            events.responses.add(request_id=stream.request_id, complete=complete(stream.request))
        self._finished.clear()
        self._send(events)

    def _send(self, events: fpb.CoreEvents) -> None:
        try:
            self.socket.write_now(events)
            if self.socket.unread_bytes > MAX_UNREAD_BYTES:
                raise ConnectionError(f"the front-end left {self.socket.unread_bytes} bytes unread")
        except (ConnectionError, step_socket.FrameError) as e:
            log.warning("front-end lost: its requests are aborted", extra={"error": str(e)})
            self.socket.close()  # serve() sees the end and aborts them

    def _close(self) -> None:
        for request_id in self.streams:
            self.scheduler.abort(request_id, cancelled=True)
        self.streams.clear()
        self.socket.close()


class CoreSocketServer:
    """Listens on the core socket for front-ends (one in the shipped setup) once the scheduler is up."""

    def __init__(self, scheduler: Scheduler, metrics: VerifierMetrics, model_name: str, max_bytes: int):
        self.scheduler, self.metrics, self.model_name = scheduler, metrics, model_name
        self.max_bytes = max_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, path: str) -> None:
        self._server = await step_socket.serve(path, self._on_connection)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        socket = step_socket.MessageSocket(reader, writer, fpb.CoreCall, self.max_bytes)
        connection = FrontendConnection(socket, self.scheduler, self.metrics, self.model_name)
        log.info("front-end connected")
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await connection.serve()
        finally:
            self._connections.discard(task)
            log.info("front-end disconnected")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)


class SplitVerifier:
    """The core process of a verifier split in two: the front-end process it starts (`frontend`: its argv,
    less the socket, and environment), which binds the client port at once, and the scheduler it serves
    that front-end over the core socket once the model is loaded."""

    def __init__(self, options: grpc_common.ServerOptions, settings: VerifierSettings,
                 metrics: VerifierMetrics, frontend: tuple[list[str], dict[str, str]]):
        self.options, self.settings, self.metrics, self._frontend = options, settings, metrics, frontend
        self._directory = tempfile.mkdtemp(prefix="specwire-core-")  # 0700: only this user reaches the socket
        self.path = os.path.join(self._directory, "core.sock")
        self.process: asyncio.subprocess.Process | None = None
        self.scheduler: Scheduler | None = None
        self._server: CoreSocketServer | None = None

    async def start_frontend(self) -> None:
        argv, env = self._frontend
        self.process = await asyncio.create_subprocess_exec(*argv, "--core-socket", self.path, env=env)
        log.info("front-end started", extra={"pid": self.process.pid, "listen": self.options.listen,
                                             "core_socket": self.path})

    async def serve(self, engine: TargetEngine, tokenizer: Tokenizer, link: LocalDrafterLink | None,
                    model_name: str) -> None:
        """Starts the scheduler on `engine` and lets the front-end in."""
        self.scheduler = start_scheduler(self.settings, self.metrics, engine, tokenizer, link)
        bound = self.options.max_message_bytes
        self._server = CoreSocketServer(self.scheduler, self.metrics, model_name, bound)
        await self._server.start(self.path)
        log.info("verifier core ready", extra={"model": model_name, "device": str(engine.device),
                                               "drafter": self.settings.drafter})

    async def start(self, engine: TargetEngine, tokenizer: Tokenizer, link: LocalDrafterLink | None,
                    model_name: str) -> None:
        """The front-end, then the scheduler: for a caller whose model is loaded already (serve_core loads
        it while the front-end starts)."""
        await self.start_frontend()
        await self.serve(engine, tokenizer, link, model_name)

    async def stop(self) -> int:
        """Drains the front-end, waits for it to exit and closes: returns its exit code."""
        self.drain()
        returncode = await self.process.wait()
        await self.close()
        return returncode

    def drain(self) -> None:
        """The front-end drains: in-flight streams get the grace period while this process serves them."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._server is not None:
            await self._server.close()
        if self.scheduler is not None:
            self.scheduler.draining = True
            await self.scheduler.close()
        shutil.rmtree(self._directory, ignore_errors=True)


async def serve_core(options: grpc_common.ServerOptions, settings: VerifierSettings, metrics: VerifierMetrics,
                     load: Callable[[], Awaitable[tuple]], frontend: tuple[list[str], dict[str, str]]) -> int:
    """`specwire verifier --frontend process`: starts the front-end, loads the model (`load`: engine,
    tokenizer, co-located link or None, model name), serves until the front-end exits. SIGTERM / SIGINT go on
    to the front-end, which drains. Returns 0 after a signal, 1 if the front-end exited on its own."""
    verifier = SplitVerifier(options, settings, metrics, frontend)
    loop, signalled = asyncio.get_running_loop(), []

    def on_signal(sig: signal.Signals) -> None:
        log.info("signal: the front-end drains", extra={"signal": signal.Signals(sig).name})
        signalled.append(sig)
        verifier.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await verifier.start_frontend()
        exited = loop.create_task(verifier.process.wait())
        loading = loop.create_task(load())
        await asyncio.wait((loading, exited), return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            loading.cancel()
        else:
            await verifier.serve(*loading.result())
            gc.collect()  # as GrpcServer.serve_forever: the start-up's objects out of the collector's reach
            gc.freeze()
        returncode = await exited
        if not signalled:
            log.error("the front-end exited on its own", extra={"returncode": returncode})
        return 0 if signalled else 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await verifier.close()
        metrics.close()
