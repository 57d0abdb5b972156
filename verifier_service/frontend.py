"""`specwire verifier-frontend`: the client-facing half of a verifier split in two processes.

`specwire verifier --frontend process` starts it: it serves the Generation service (with health, reflection,
TLS and the token, as the one-process verifier does) and relays each call to the core over the core socket
(core_socket.py, proto/specwire/v1/frontend.proto). Each client stream's writes happen here, on this process's
own core and GIL, off the loop that launches the verifications, and so does detokenising (with the tokenizer
the core sends first) for requests without stop strings. It loads no model and imports no torch.

Until the core is up, Generate answers UNAVAILABLE ("the model is still loading") and health says
NOT_SERVING. If the core goes away, every open stream ends with UNAVAILABLE and this process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import uuid
from collections import deque

import grpc
from specwire.verifier.request_error import RequestError, error_response, in_flight_already

from specwire import grpc_common, step_socket
from specwire.tokenizer import IncrementalDetokenizer, Tokenizer
from specwire.v1 import frontend_pb2 as fpb
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

log = logging.getLogger("specwire.verifier.frontend")

CONNECT_RETRY_SECONDS = 0.05
MODEL_INFO_TIMEOUT_SECONDS = 10.0


class Responses:
    """One open request's responses from the core, in order: at most one a round and its last. With a
    detokenizer (a request without stop strings) the core sends token ids only and the text is made here."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None = None):
        self._waiting: deque[pb.GenerateResponse] = deque()
        self._arrived = asyncio.Event()
        self._detokenizer = detokenizer

    def put(self, response: pb.GenerateResponse) -> None:
        self._waiting.append(response)
        self._arrived.set()

    async def next(self) -> pb.GenerateResponse:
        """The next response, with the chunks already waiting behind it joined to it: a stream that fell
        behind its request catches up in one write (as verifier.server.with_waiting does in-process)."""
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        response = self._waiting.popleft()
        kind, detokenizer = response.WhichOneof("event"), self._detokenizer
        if kind == "chunk":
            while self._waiting and self._waiting[0].WhichOneof("event") == "chunk":
                following = self._waiting.popleft()
                response.chunk.token_ids.extend(following.chunk.token_ids)
                response.chunk.text += following.chunk.text
            if detokenizer is not None:
                response.chunk.text = detokenizer.push(list(response.chunk.token_ids))
        elif kind == "complete" and detokenizer is not None and (rest := detokenizer.flush()):
            self._waiting.appendleft(response)  # the text held back (a split character) goes first
            response = pb.GenerateResponse(request_id=response.request_id, chunk=pb.Chunk(text=rest))
        return response


class CoreLink:
    """The connection to the core: calls out; each open stream's responses in (read from the start, on the
    running loop)."""

    def __init__(self, socket: step_socket.MessageSocket, tokenizer: Tokenizer):
        self._socket, self.tokenizer = socket, tokenizer
        self.streams: dict[str, Responses] = {}
        self._model_info: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count(1)
        self.lost = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, path: str, max_bytes: int, give_up: asyncio.Event) -> CoreLink | None:
        """Waits for the core to listen (it does once its model is loaded); None once `give_up` is set or
        the process that started this one has gone."""
        parent = os.getppid()
        while not give_up.is_set() and os.getppid() == parent:
            try:
                socket = await step_socket.MessageSocket.connect(path, fpb.CoreEvents, max_bytes)
            except OSError:
                await asyncio.sleep(CONNECT_RETRY_SECONDS)
                continue
            hello = await socket.read()
            if hello is None or not hello.tokenizer:
                raise step_socket.FrameError("the core's first message holds no tokenizer")
            return cls(socket, Tokenizer.for_decoding(hello.tokenizer))
        return None

    def open(self, request_id: str, stop: bool) -> Responses:
        """A stream for request_id, which the caller then submits; stop: the request has stop strings (its
        text comes from the core)."""
        if request_id in self.streams:
            raise in_flight_already(request_id)
        if self.lost.is_set():
            raise RequestError(pb.ERROR_CODE_UNAVAILABLE, "the verifier's core has gone")
        detokenizer = None if stop else IncrementalDetokenizer(self.tokenizer)
        responses = self.streams[request_id] = Responses(detokenizer)
        return responses

    def call(self, call: fpb.CoreCall) -> None:
        try:
            self._socket.write_now(call)
        except ConnectionError:
            self._lose("the core socket closed")

    async def model_info(self) -> pb.ModelInfo:
        nonce = next(self._nonces)
        answer = self._model_info[nonce] = asyncio.get_running_loop().create_future()
        self.call(fpb.CoreCall(model_info=nonce))
        try:
            return await asyncio.wait_for(answer, MODEL_INFO_TIMEOUT_SECONDS)
        finally:
            self._model_info.pop(nonce, None)

    async def _read(self) -> None:
        reason = "the core closed the socket"
        try:
            while (events := await self._socket.read()) is not None:
                for response in events.responses:
                    stream = self.streams.get(response.request_id)
                    if stream is not None:  # else its client has gone
                        stream.put(response)
                answer = self._model_info.get(events.model_info_nonce)
                if answer is not None and not answer.done():
                    answer.set_result(events.model_info)
        except (step_socket.FrameError, ConnectionError) as e:
            reason = str(e)
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        log.error("the verifier's core is gone: open streams end UNAVAILABLE", extra={"reason": reason})
        self.lost.set()
        gone = RequestError(pb.ERROR_CODE_UNAVAILABLE, f"the verifier's core has gone ({reason})")
        for request_id, stream in self.streams.items():
            stream.put(error_response(request_id, gone))
        for answer in self._model_info.values():
            if not answer.done():
                answer.set_exception(ConnectionError(reason))
        self._socket.close()


class FrontendService(generation_pb2_grpc.GenerationServicer):
    """The Generation service, relayed to the core."""

    def __init__(self):
        self.core: CoreLink | None = None  # set once connected; until then UNAVAILABLE

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        core = self.core
        try:
            if core is None:
                raise RequestError(pb.ERROR_CODE_UNAVAILABLE, "the model is still loading")
            responses = core.open(request_id, stop=bool(request.sampling.stop))
        except RequestError as e:
            yield error_response(request_id, e)
            return
        request.request_id = request_id
        core.call(fpb.CoreCall(submit=request))
        done = False
        try:
            while not done:
                response = await responses.next()
                done = response.WhichOneof("event") != "chunk"
                yield response
        finally:
            del core.streams[request_id]
            if not done:  # the client went away (cancel, deadline): the core frees its slot
                core.call(fpb.CoreCall(abort=fpb.CoreAbort(request_id=request_id, cancelled=True)))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        core = self.core
        found = core is not None and request.request_id in core.streams
        if found:
            core.call(fpb.CoreCall(abort=fpb.CoreAbort(request_id=request.request_id)))
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ModelInfo:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        try:
            return await self.core.model_info()
        except (ConnectionError, TimeoutError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the verifier's core did not answer: {e}")


async def serve(options: grpc_common.ServerOptions, core_socket: str) -> int:
    """Serves until drained (SIGTERM) or the core is gone; returns the exit code."""
    server = grpc_common.GrpcServer(options)
    service = FrontendService()
    server.add_service(grpc_common.GENERATION_SERVICE, generation_pb2_grpc.add_GenerationServicer_to_server,
                       service, require_token=True)
    lost = False

    async def on_core_lost(core: CoreLink) -> None:
        nonlocal lost
        await core.lost.wait()
        lost = True
        await server.drain(0.5)  # the streams' last messages (UNAVAILABLE) go out

    async def connect() -> None:
        core = await CoreLink.connect(core_socket, options.max_message_bytes, server.draining)
        if core is None:
            return
        service.core = core
        watch.append(asyncio.get_running_loop().create_task(on_core_lost(core)))
        await server.set_serving(True)
        log.info("front-end ready", extra={"core_socket": core_socket})

    watch: list[asyncio.Task] = []
    await server.serve_forever(on_ready=connect)
    return 1 if lost else 0


def command(options: grpc_common.ServerOptions, log_level: str, log_format: str
            ) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start this process for a core with `options` (its own server flags):
    the core socket's path is appended by the caller. The token goes in the environment, not the argv,
    which other users of the host can read."""
    argv = [sys.executable, "-m", "specwire", "verifier-frontend", "--listen", options.listen,
            "--max-message-mb", repr(options.max_message_bytes / (1 << 20)),
            "--grace-seconds", repr(options.grace_seconds),
            "--log-level", log_level, "--log-format", log_format]
    for flag, value in (("--health-listen", options.health_listen), ("--tls-cert", options.tls_cert),
                        ("--tls-key", options.tls_key), ("--tls-client-ca", options.tls_client_ca)):
        if value is not None:
            argv += [flag, value]
    env = dict(os.environ)
    env.pop("SPECWIRE_TOKEN", None)
    if options.token is not None:
        env["SPECWIRE_TOKEN"] = options.token
    return argv, env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    grpc_common.add_server_arguments(parser, default_listen="0.0.0.0:50051")
    parser.add_argument("--core-socket", required=True, metavar="PATH",
                        help="the verifier core's Unix socket (`specwire verifier --frontend process` starts "
                             "this command and names it)")
    grpc_common.add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    grpc_common.setup_logging(args.log_level, args.log_format)
    options = grpc_common.ServerOptions.from_args(args)
    return grpc_common.run(serve(options, args.core_socket), switch_interval=args.switch_interval)
