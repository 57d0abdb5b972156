"""A tiny real Generation servicer for the plumbing and client tests (no model; the verifier has its own).

Its "model" reads the prompt's UTF-8 bytes as token ids and answers with the upper-cased prompt, two tokens
per chunk, like a speculating server that gains two tokens a round. Run as a script it serves on a port and
prints it, so tests can SIGTERM a real process.
"""

import asyncio
import sys
import uuid

from specwire import grpc_common
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

DEFAULT_MAX_TOKENS = 64


def expected_output(prompt: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> bytes:
    return prompt.upper().encode()[:max_tokens]


class ToyGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, seconds_per_chunk: float = 0.0):
        self.seconds_per_chunk = seconds_per_chunk
        self.running: dict[str, asyncio.Event] = {}

    async def Generate(self, request: pb.GenerateRequest, context):
        request_id = request.request_id or uuid.uuid4().hex
        if request.WhichOneof("prompt") != "text" or not request.text:
            yield pb.GenerateResponse(request_id=request_id, error=pb.Error(
                code=pb.ERROR_CODE_INVALID_ARGUMENT, message="the toy server takes non-empty text prompts"))
            return
        params = request.sampling
        max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        output = expected_output(request.text, max_tokens)
        aborted = self.running[request_id] = asyncio.Event()
        try:
            sent = 0
            while sent < len(output) and not aborted.is_set():
                chunk = output[sent:sent + 2]
                sent += len(chunk)
                yield pb.GenerateResponse(request_id=request_id, chunk=pb.Chunk(
                    token_ids=list(chunk), text=chunk.decode()))
                await asyncio.sleep(self.seconds_per_chunk)
        finally:
            del self.running[request_id]
        drafts = (sent + 1) // 2
        reason = (pb.FINISH_REASON_ABORT if aborted.is_set() else
                  pb.FINISH_REASON_LENGTH if sent == max_tokens else pb.FINISH_REASON_STOP)
        usage = pb.Usage(prompt_tokens=len(request.text.encode()), completion_tokens=sent, drafts=drafts,
                         draft_tokens=2 * drafts, accepted_tokens=sent - drafts,
                         mean_acceptance_length=sent / drafts if drafts else 0.0, seconds=0.5,
                         time_to_first_token_seconds=0.1, speculative=True)
        complete = pb.Complete(finish_reason=reason, usage=usage)
        yield pb.GenerateResponse(request_id=request_id, complete=complete)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        event = self.running.get(request.request_id)
        if event is not None:
            event.set()
        return pb.AbortResponse(found=event is not None)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return pb.ModelInfo(model_name="toy-bytes", vocab_size=256, num_running=len(self.running),
                            free_slots=8 - len(self.running), max_slots=8)


def add_toy(server: grpc_common.GrpcServer, servicer: ToyGeneration, require_token: bool = False) -> None:
    server.add_service(grpc_common.GENERATION_SERVICE, generation_pb2_grpc.add_GenerationServicer_to_server,
                       servicer, require_token=require_token)


async def _serve(seconds_per_chunk: float, grace_seconds: float) -> None:
    server = grpc_common.GrpcServer(grpc_common.ServerOptions(grace_seconds=grace_seconds,
                                                              health_listen="127.0.0.1:0"))
    add_toy(server, ToyGeneration(seconds_per_chunk))
    await server.start()
    await server.set_serving(True)
    print(server.port, server.health_port, flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    grpc_common.setup_logging("INFO", "json")
    grpc_common.run(_serve(float(sys.argv[1]), float(sys.argv[2])))
