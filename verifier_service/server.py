"""The client-facing Generation service on top of the scheduler, and the verifier process around it.

A request's own failure (bad parameters, prompt too long, queue full) is an in-band Error message with a
google.rpc code; the RPC itself ends OK. A cancelled call or an expired deadline aborts the request, which
frees its slot here and its state on the drafter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from specwire.verifier.drafter_link import DrafterLink, LocalDrafterLink
from specwire.verifier.request_error import RequestError, error_response
from specwire.verifier.scheduler import Output, Request, Scheduler, SchedulerConfig

from specwire import grpc_common
from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import Tokenizer
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc
from specwire.wire import PROTOCOL_VERSION

log = logging.getLogger("specwire.verifier")

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def with_waiting(outputs: asyncio.Queue, out: Output) -> tuple[Output, int]:
    """`out` and every output already waiting behind it, as one, and how many joined it: a stream that fell
    behind its request (the loop busy with rounds, as a co-located verifier's is) catches up in one write
    instead of one a round.
    Modelled on the CPU (bench/bench_stream_starvation.py, bench/results/stream_starvation_cpu.jsonl): 16
    streams, 55 rounds of 2 ms, the loop yielding once a round: each stream's last chunk came 21 ms after its
    round, 2.3 ms with this; where the loop yields 0.3 ms or more a round, no stream fell behind."""
    joined = 0
    while out.finish_reason is None and not outputs.empty():
        more = outputs.get_nowait()
        out = Output(out.token_ids + more.token_ids, out.text + more.text, more.finish_reason, more.error)
        joined += 1
    return out, joined


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, model_name: str, metrics: VerifierMetrics):
        self.model_name, self.metrics = model_name, metrics
        self.scheduler: Scheduler | None = None  # set once the model is loaded; until then UNAVAILABLE

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if self.scheduler is None:
                raise RequestError(pb.ERROR_CODE_UNAVAILABLE, "the model is still loading")
            prompt, params = parse_request(self.scheduler, request)
            r = self.scheduler.submit(prompt, params, request_id)
        except RequestError as e:
            yield rejected(self.metrics, request_id, e)
            return
        done = False
        try:
            while not done:
                out, joined = with_waiting(r.outputs, await r.outputs.get())
                if joined:
                    self.metrics.stream_outputs_joined.inc(joined)
                done = out.finish_reason is not None
                if out.token_ids or out.text:
                    yield pb.GenerateResponse(request_id=request_id,
                                              chunk=pb.Chunk(token_ids=out.token_ids, text=out.text))
                if out.finish_reason == "error":
                    yield error_response(request_id, RequestError(pb.ERROR_CODE_INTERNAL, out.error))
                    return
            yield pb.GenerateResponse(request_id=request_id, complete=complete(r))
        finally:
            if not done:  # the client went away (cancel, deadline): free the slot and the drafter state
                self.scheduler.abort(request_id, cancelled=True)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = self.scheduler is not None and self.scheduler.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ModelInfo:
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return model_info(self.scheduler, self.model_name)


def rejected(metrics: VerifierMetrics, request_id: str, e: RequestError) -> pb.GenerateResponse:
    """A request refused before it was queued, counted by its code, as its stream's one message."""
    metrics.rejected[pb.ErrorCode.Name(e.code).removeprefix("ERROR_CODE_").lower()].inc()
    return error_response(request_id, e)


def parse_request(s: Scheduler, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the sampling parameters; RequestError(INVALID_ARGUMENT) if malformed."""
    prompt_kind = request.WhichOneof("prompt")
    if prompt_kind == "token_ids":
        if request.chat:
            raise RequestError(pb.ERROR_CODE_INVALID_ARGUMENT, "chat needs a text prompt, not token ids")
        prompt = list(request.token_ids.ids)
    elif prompt_kind == "text" and request.text:
        text = request.text
        if request.chat:
            text = _render_chat(s.tokenizer, [{"role": "user", "content": text}])
        prompt = s.tokenizer.encode(text, add_special_tokens=not request.chat)  # a template holds them
    elif prompt_kind == "messages":  # `chat` is implied; the rendered template holds the special tokens
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        prompt = s.tokenizer.encode(_render_chat(s.tokenizer, messages), add_special_tokens=False)
    else:
        prompt = []
    sp = request.sampling
    room = max(1, s.max_context - len(prompt))
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else min(s.config.default_max_tokens, room)
    params = SamplingParams(
        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        seed=sp.seed if sp.HasField("seed") else None, max_tokens=max_tokens, stop=tuple(sp.stop),
        ignore_eos=sp.ignore_eos,
    )
    return prompt, params


def complete(r: Request) -> pb.Complete:
    """A finished request's last message: why it ended and its counts."""
    usage = pb.Usage(
        prompt_tokens=len(r.prompt), completion_tokens=r.num_output, drafts=r.drafts,
        draft_tokens=r.draft_tokens, accepted_tokens=r.accepted_tokens,
        mean_acceptance_length=1 + r.accepted_tokens / r.drafts if r.drafts else 0.0,
        seconds=(r.last_token_at or time.perf_counter()) - r.arrived,
        time_to_first_token_seconds=max(0.0, r.first_token_at - r.arrived),
        speculative=r.draft_tokens > 0,
    )
    return pb.Complete(finish_reason=_FINISH[r.finish_reason], usage=usage, matched_stop=r.matched_stop)


def model_info(s: Scheduler, model_name: str) -> pb.ModelInfo:
    """What GetModelInfo answers: the model, how it speculates, the scheduler's load now."""
    c, link = s.engine.config, s.link
    speculation = pb.SpeculationInfo(
        enabled=link is not None and s.config.num_speculative_tokens > 0,
        drafter_connected=link is not None and link.connected,
        num_speculative_tokens=s.config.num_speculative_tokens if link is not None else 0,
        drafter_head=link.info.head if link is not None and link.info is not None else "",
    )
    return pb.ModelInfo(
        model_name=model_name, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        max_context=s.max_context, tokenizer_fingerprint=s.tokenizer.fingerprint,
        eos_token_ids=list(s.tokenizer.eos_token_ids), speculation=speculation,
        num_running=len(s.running), num_waiting=len(s.waiting), free_slots=s.engine.num_free_slots,
        max_slots=s.engine.max_slots, protocol_version=PROTOCOL_VERSION,
    )


CHAT_ROLES = ("system", "user", "assistant")


def _render_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation through the model's chat template; RequestError(INVALID_ARGUMENT) if it cannot be."""
    invalid = pb.ERROR_CODE_INVALID_ARGUMENT
    if not messages:
        raise RequestError(invalid, "messages is empty: send at least one user message")
    for i, m in enumerate(messages):
        if m["role"] not in CHAT_ROLES:
            roles = ", ".join(CHAT_ROLES)
            raise RequestError(invalid, f"messages[{i}].role is {m['role']!r}, not one of {roles}")
    if not any(m["role"] == "user" for m in messages):
        raise RequestError(invalid, "messages has no user message")
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as e:  # no template, or the template itself refused the conversation
        raise RequestError(invalid, str(e)) from None


@dataclass
class VerifierSettings:
    """What `specwire verifier` runs, beyond the gRPC server options."""

    drafter: str | None = None  # HOST:PORT; None = target-only
    drafter_socket: str | None = None  # the drafter's step socket (same host): the Draft stream goes over it
    shared_features: bool = True  # a drafter on this host maps the feature table (specwire.shared_features)
    drafts_on_device: bool = True  # its queued drafts read on this GPU where it writes them (DrafterLink)
    drafter_channel: grpc_common.ChannelOptions = grpc_common.ChannelOptions()
    step_timeout: float = 1.0  # seconds a step waits for its drafts before verifying without them
    scheduler: SchedulerConfig = SchedulerConfig()
    model_name: str = ""


class VerifierServer:
    """The gRPC server, the scheduler and the drafter link of one verifier process."""

    def __init__(self, options: grpc_common.ServerOptions, settings: VerifierSettings,
                 metrics: VerifierMetrics | None = None):
        self.settings, self.metrics = settings, metrics or VerifierMetrics()
        self.grpc = grpc_common.GrpcServer(options)
        self.service = GenerationService(settings.model_name, self.metrics)
        add = generation_pb2_grpc.add_GenerationServicer_to_server
        self.grpc.add_service(grpc_common.GENERATION_SERVICE, add, self.service, require_token=True)
        self.scheduler: Scheduler | None = None

    async def start(self, engine: TargetEngine, tokenizer: Tokenizer, link: LocalDrafterLink | None = None
                    ) -> int:
        """Binds the port (unless bound), starts the scheduler on `engine`, then reports SERVING. link: a
        co-located drafter (specwire.colocated); else settings.drafter names a remote one, or none."""
        port = self.grpc.port or await self.grpc.start()
        self.attach(engine, tokenizer, link)
        await self.grpc.set_serving(True)
        return port

    def attach(self, engine: TargetEngine, tokenizer: Tokenizer, link: LocalDrafterLink | None = None
               ) -> None:
        self.scheduler = start_scheduler(self.settings, self.metrics, engine, tokenizer, link)
        self.service.scheduler = self.scheduler

    async def stop(self, grace: float | None = 0.0) -> None:
        """Drains (in-flight requests get `grace` seconds), then stops the scheduler and the drafter link."""
        if self.scheduler is not None:
            self.scheduler.draining = True
        await self.grpc.drain(grace)
        if self.scheduler is not None:
            await self.scheduler.close()
        self.metrics.close()


def start_scheduler(settings: VerifierSettings, metrics: VerifierMetrics, engine: TargetEngine,
                    tokenizer: Tokenizer, link: LocalDrafterLink | None = None) -> Scheduler:
    """The scheduler on `engine`, started, with its drafter: `link` (co-located), else the one
    settings.drafter names, or none."""
    s = settings
    if link is None and s.drafter:
        share = s.shared_features and engine.device.type == "cuda"
        link = DrafterLink(s.drafter, metrics, s.drafter_channel, step_timeout=s.step_timeout,
                           socket_path=s.drafter_socket, share_from=engine.device if share else None,
                           drafts_on_device=s.drafts_on_device)
    scheduler = Scheduler(engine, tokenizer, metrics, s.scheduler, link)
    metrics.max_requests_waiting.set(s.scheduler.max_waiting)
    metrics.kv_slots.labels(state="total").set(engine.max_slots)
    # Read at scrape time, so the gauge is never stale (the soak checks it returns to 0).
    metrics.kv_slots.labels(state="used").set_function(lambda: engine.max_slots - engine.num_free_slots)
    scheduler.start()
    return scheduler
