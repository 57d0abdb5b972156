"""The two gRPC services end to end, real servers on 127.0.0.1 in-process: a tiny random target with the
SmolLM2 tokenizer, and an EAGLE-1 head built to predict that target well, so drafts are often but not
always accepted (both paths of the rejection sampler run).

Greedy output through both services must equal target-only greedy decoding (an independent loop of
prefill/decode + argmax), whatever the drafter does: drafts, dies, restarts or sends garbage.
"""

import asyncio
import contextlib
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig
from specwire.drafter.proposer import EagleProposer
from specwire.drafter.server import DrafterService
from specwire.kernels.rejection_sampler import rejection_sample
from specwire.verifier import frontend
from specwire.verifier.core_socket import SplitVerifier
from specwire.verifier.drafter_link import LocalDrafterLink
from specwire.verifier.scheduler import SchedulerConfig
from specwire.verifier.server import VerifierServer, VerifierSettings

from specwire import grpc_common, step_socket
from specwire.commands.demo import free_port
from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import DRAFTING_MODES, DrafterMetrics, VerifierMetrics
from specwire.tokenizer import load_tokenizer
from specwire.v1 import drafter_pb2 as dpb
from specwire.v1 import drafter_pb2_grpc, generation_pb2_grpc
from specwire.v1 import generation_pb2 as pb
from specwire.weights import checkpoint_shapes

VOCAB, H = 49152, 64
MAX_CONTEXT = 160
K = 3
BRANCHES = 4  # speculation-cache table entries per request
# Tests wait for every table (on a shared CPU the drafter is often slower than the tiny target), so cache hits
# and misses depend on the drafts alone; the default waits half a verification.


def tiny_target() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Random weights whose attention and MLP only nudge the residual stream: the next token is mostly a
    function of the current one (which the head below predicts), at times of the context (which it cannot)."""
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_ids=(2,),
    )
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, shape in checkpoint_shapes(config).items():
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = torch.randn(shape, generator=g) * 0.06
        else:
            sd[name] = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    sd["model.embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    return config, sd


def bigram_head(config: ModelConfig, sd: dict[str, torch.Tensor], device: str = "cpu",
                max_positions: int = MAX_CONTEXT) -> EagleHead:
    """EAGLE-1 head whose output is embed(next token): through the target's lm_head it drafts the token the
    target would pick if attention and MLP were off."""
    layer = ModelConfig(**{**config.__dict__, "num_layers": 1})
    hidden = config.hidden_size
    head_config = EagleHeadConfig(arch="eagle1", layer=layer, target_hidden_size=hidden,
                                  target_vocab_size=config.vocab_size)
    head = EagleHead(head_config, sd, torch.float32, device, max_positions=max_positions)
    head.init_weights(0)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)  # x = embed(token): the target feature is ignored
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


class Loop:
    """An asyncio event loop on a thread: the servers live there, the tests call in with `run`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Drafter:
    """A real drafter server; `service_class` lets a test swap in a misbehaving servicer."""

    def __init__(self, loop: Loop, checkpoint, fingerprint: str, port: int = 0, service_class=DrafterService,
                 device: str = "cpu", step_socket: str | None = None,
                 max_message_bytes: int = grpc_common.DEFAULT_MAX_MESSAGE_BYTES):
        """step_socket: also serve the Draft stream on this Unix socket path."""
        self.loop, self.metrics = loop, DrafterMetrics()
        config, sd = checkpoint
        proposer = EagleProposer(bigram_head(config, sd, device), max_requests=48, max_context=MAX_CONTEXT,
                                 max_drafts=K, max_top_k=16, max_branches=BRANCHES)
        self.port = loop.run(self._start(port, service_class, proposer, config, fingerprint, step_socket,
                                         max_message_bytes))

    async def _start(self, port, service_class, proposer, config, fingerprint, socket_path, max_bytes) -> int:
        # grpc.aio objects belong to the loop they are made on
        self.server = grpc_common.GrpcServer(grpc_common.ServerOptions(listen=f"127.0.0.1:{port}",
                                                                       max_message_bytes=max_bytes))
        self.service = service_class(self.metrics, self.server.draining, max_bytes)
        self.service.load(proposer, config, fingerprint, "eagle1:bigram")
        self.server.add_service(grpc_common.DRAFTER_SERVICE, drafter_pb2_grpc.add_DrafterServicer_to_server,
                                self.service)
        self.sockets = socket_path and await step_socket.serve(socket_path, self.service.serve_socket)
        port = await self.server.start()
        await self.server.set_serving(True)
        return port

    def num_requests(self) -> int:
        return len(self.service._known)

    def kill(self):
        self.loop.run(self._stop())

    async def _stop(self) -> None:
        if self.sockets:  # on the loop's thread: asyncio servers are not thread-safe
            self.sockets.close()
        await self.server.drain(0)


def colocated(checkpoint, tokenizer, metrics: VerifierMetrics, inline: bool = False, device: str = "cpu"
              ) -> LocalDrafterLink:
    """The world's drafter (the bigram head), but in the verifier's process behind the in-process link
    (inline: serial steps on the loop, as on a GPU), on the verifier's device."""
    config, sd = checkpoint
    proposer = EagleProposer(bigram_head(config, sd, device), max_requests=48, max_context=MAX_CONTEXT,
                             max_drafts=K, max_top_k=16, max_branches=BRANCHES)
    service = DrafterService(DrafterMetrics())
    service.load(proposer, config, tokenizer.fingerprint, "eagle1:bigram")
    owned = set()
    return LocalDrafterLink(functools.partial(service.run_step, 0, owned), service.info, service.mismatch,
                            metrics, proposer.device, step_timeout=5.0, inline=inline,
                            queue=functools.partial(service.queue_drafts, 0),
                            take=functools.partial(service.take_drafts, owned),
                            lookups=service.lookups)


def serving(channel: grpc.Channel) -> bool:
    """Whether the server behind `channel` is up and says SERVING."""
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return status.status == health_pb2.HealthCheckResponse.SERVING


class Verifier:
    def __init__(self, loop: Loop, checkpoint, tokenizer, drafter_port: int | str | None, max_slots: int = 16,
                 cache_branches: int = BRANCHES, step_timeout: float = 5.0, device: str = "cpu",
                 table_wait: float | None = 5.0, just_in_time_wait: float | None = 5.0,
                 max_waiting: int = 64, drafting_epoch: int = 0, drafter_socket: str | None = None,
                 max_message_bytes: int = grpc_common.DEFAULT_MAX_MESSAGE_BYTES,
                 queue_drafts: bool | None = None, drafting_modes: tuple[str, ...] | None = None,
                 frontend: str = "inline", queued_tables: int = 0, forced_hit_rate: float | None = None):
        """frontend "process": the client streams go through a real `specwire verifier-frontend` process
        this one starts (core_socket.SplitVerifier), as `specwire verifier --frontend process` runs."""
        self.loop, self.metrics = loop, VerifierMetrics()
        self.engine = TargetEngine(checkpoint=checkpoint, device=device, dtype=torch.float32,
                                   max_slots=max_slots, max_context=MAX_CONTEXT)
        settings = VerifierSettings(
            drafter=f"127.0.0.1:{drafter_port}" if isinstance(drafter_port, int) else None,
            drafter_socket=drafter_socket,
            drafter_channel=grpc_common.ChannelOptions(max_message_bytes=max_message_bytes),
            step_timeout=step_timeout,
            scheduler=SchedulerConfig(num_speculative_tokens=K, max_waiting=max_waiting,
                                      default_max_tokens=16, cache_branches=cache_branches,
                                      table_wait=table_wait, just_in_time_wait=just_in_time_wait,
                                      drafting_epoch=drafting_epoch, drafting_modes=drafting_modes,
                                      queue_drafts=queue_drafts, queued_tables=queued_tables,
                                      forced_hit_rate=forced_hit_rate),
            model_name="tiny",
        )
        link = (colocated(checkpoint, tokenizer, self.metrics, inline=drafter_port == "colocated-inline",
                          device=device) if str(drafter_port).startswith("colocated") else None)
        start = self._start_split if frontend == "process" else self._start
        self.port = loop.run(start(settings, tokenizer, link))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        if frontend == "process":
            poll(lambda: serving(self.channel), timeout=60, what="the front-end process SERVING")

    async def _start(self, settings, tokenizer, link) -> int:
        self.server = VerifierServer(grpc_common.ServerOptions(listen="127.0.0.1:0"), settings, self.metrics)
        return await self.server.start(self.engine, tokenizer, link)

    async def _start_split(self, settings, tokenizer, link) -> int:
        port = free_port()
        options = grpc_common.ServerOptions(listen=f"127.0.0.1:{port}")
        command = frontend.command(options, "INFO", "text")
        self.server = SplitVerifier(options, settings, self.metrics, command)
        await self.server.start(self.engine, tokenizer, link, settings.model_name)
        return port

    def info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)

    def wait_connected(self, connected: bool = True, timeout: float = 30):
        deadline = time.time() + timeout
        while self.info().speculation.drafter_connected != connected:
            assert time.time() < deadline, f"drafter_connected never became {connected}"
            time.sleep(0.05)

    def generate(self, prompt: list[int] | str, max_tokens: int = 16, timeout: float = 120, **sampling):
        """(token ids, text, Complete or Error) of one streamed request."""
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                **sampling))
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        ids, text = [], ""
        for response in self.stub.Generate(request, timeout=timeout):
            kind = response.WhichOneof("event")
            if kind == "chunk":
                ids += response.chunk.token_ids
                text += response.chunk.text
            else:
                return ids, text, getattr(response, kind)
        raise AssertionError("stream ended without Complete or Error")

    def counter(self, metric, **labels) -> float:
        return (metric.labels(**labels) if labels else metric)._value.get()

    def close(self):
        self.channel.close()
        self.loop.run(self.server.stop() if isinstance(self.server, SplitVerifier) else self.server.stop(0))


@pytest.fixture(scope="module")
def world():
    yield from world_of()


def world_of(**verifier_settings):
    """The tiny target, the bigram drafter and a verifier (Verifier's settings) connected to it, as a
    fixture's body: closed when the generator ends."""
    loop = Loop()
    checkpoint = tiny_target()
    tokenizer = load_tokenizer(default_model_path())
    drafter = Drafter(loop, checkpoint, tokenizer.fingerprint)
    verifier = Verifier(loop, checkpoint, tokenizer, drafter.port, **verifier_settings)
    verifier.wait_connected()
    w = type("World", (), dict(loop=loop, checkpoint=checkpoint, tokenizer=tokenizer, drafter=drafter,
                               verifier=verifier))
    yield w
    w.verifier.close()
    w.drafter.kill()
    loop.close()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def reference_engine(checkpoint, device: str = "cpu") -> TargetEngine:
    """A one-slot float32 target engine for the target-only references."""
    return TargetEngine(checkpoint=checkpoint, device=device, dtype=torch.float32, max_slots=1,
                        max_context=MAX_CONTEXT)


def greedy_reference(checkpoint, prompt_list: list[list[int]], max_tokens: int, device: str = "cpu"
                     ) -> list[list[int]]:
    """Target-only greedy decoding, one request at a time: prefill, then decode + argmax."""
    engine = reference_engine(checkpoint, device)
    outputs = []
    for prompt in prompt_list:
        slot = engine.allocate_slot()
        tokens = [int(engine.prefill([(slot, prompt)]).logits[0].argmax())]
        while len(tokens) < max_tokens:
            logits = engine.decode([slot], [tokens[-1]], [len(prompt) + len(tokens) - 1]).logits
            tokens.append(int(logits[0].argmax()))
        engine.free_slot(slot)
        outputs.append(tokens)
    return outputs


def generate_all(verifier: Verifier, prompt_list, **kwargs) -> list:
    with ThreadPoolExecutor(len(prompt_list)) as pool:
        return list(pool.map(lambda p: verifier.generate(p, **kwargs), prompt_list))


# ---------------------------------------------------------------------------------------------- tests


def test_greedy_through_both_services_equals_target_only(world):
    v = world.verifier
    accepted_before = v.counter(v.metrics.num_accepted_tokens)
    steps_before = v.metrics.registry.get_sample_value("specwire_verify_step_seconds_count")
    paths_before = [v.counter(c) for c in (v.metrics.cache["hit"], v.metrics.just_in_time["drafted"])]
    batch = prompts(20)
    results = generate_all(v, batch, max_tokens=24)
    expected = greedy_reference(world.checkpoint, batch, 24)
    for (ids, text, complete), want in zip(results, expected, strict=True):
        assert isinstance(complete, pb.Complete) and complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert ids == want
        assert text == world.tokenizer.decode(want)
    usage = [c.usage for _, _, c in results]
    accepted = sum(u.accepted_tokens for u in usage)
    drafted = sum(u.draft_tokens for u in usage)
    # Speculation really ran, and the rejection path too (the head cannot see the context).
    assert 0 < accepted < drafted
    assert v.counter(v.metrics.num_accepted_tokens) - accepted_before == accepted
    assert all(u.mean_acceptance_length == 1 + u.accepted_tokens / u.drafts for u in usage if u.drafts)
    # Every verification is timed: at least one per 1 + k tokens of the longest request.
    steps = v.metrics.registry.get_sample_value("specwire_verify_step_seconds_count") - steps_before
    assert steps >= 24 / (1 + K)
    # Drafts came both ways: from table hits, and made just in time where a table had none.
    paths = [v.counter(c) for c in (v.metrics.cache["hit"], v.metrics.just_in_time["drafted"])]
    assert all(a > b for a, b in zip(paths, paths_before, strict=True)), (paths, paths_before)


def seeded_reference(checkpoint, prompt_list: list[list[int]], max_tokens: int, temperature: float,
                     top_p: float, seed: int) -> list[list[int]]:
    """Target-only seeded sampling, one request at a time: prefill, then decode, each token drawn by the
    rejection sampler with no drafts at its absolute position (what a verifier without a drafter does)."""
    engine = reference_engine(checkpoint)
    outputs = []
    for prompt in prompt_list:
        slot, tokens = engine.allocate_slot(), list(prompt)
        logits = engine.prefill([(slot, prompt)]).logits
        while len(tokens) < len(prompt) + max_tokens:
            out = rejection_sample(
                logits, torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), None,
                torch.tensor([temperature]), torch.tensor([0]), torch.tensor([top_p]), torch.tensor([seed]),
                torch.tensor([len(tokens)]),
            )
            tokens.append(out.token_lists()[0][0])
            logits = engine.decode([slot], [tokens[-1]], [len(tokens) - 1]).logits
        engine.free_slot(slot)
        outputs.append(tokens[len(prompt):])
    return outputs


def test_seeded_sampled_output_equals_target_only_sampling(world):
    """Seeded requests draft greedily (one-hot q), and the sampler verifies one-hot drafts by the race
    winner: the output is the target-only sample token for token, whatever the drafts and the batch."""
    v = world.verifier
    batch = prompts(6, seed=17)
    # A low temperature so that the random target's p is peaked enough for drafts to be accepted.
    sampling = {"temperature": 0.3, "top_p": 0.9, "seed": 4321}
    results = generate_all(v, batch, max_tokens=20, **sampling)
    assert [r[0] for r in results] == seeded_reference(world.checkpoint, batch, 20, 0.3, 0.9, 4321)
    usage = [r[2].usage for r in results]
    assert 0 < sum(u.accepted_tokens for u in usage) < sum(u.draft_tokens for u in usage)


def test_seeded_sampling_repeats_whatever_the_batch(world):
    v = world.verifier
    prompt = prompts(1, seed=5)[0]
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone = v.generate(prompt, max_tokens=20, **sampling)[0]
    batched = generate_all(v, [prompt, *prompts(5, seed=6)], max_tokens=20, **sampling)
    assert batched[0][0] == alone
    assert v.generate(prompt, max_tokens=20, **(sampling | {"seed": 99}))[0] != alone
    # Unseeded sampled requests get tables of top-K drafts with sparse q (every entry checked and none
    # refused); on this random target a sampled bonus is rarely among the head's guesses, so most rounds miss.
    lookups = sum(v.counter(v.metrics.cache[r]) for r in ("hit", "miss"))
    bad = v.counter(v.metrics.bad_payloads, reason="bad_tensor")
    ids, _, complete = v.generate(prompt, max_tokens=20, temperature=0.7)
    assert len(ids) == 20 and complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(v.counter(v.metrics.cache[r]) for r in ("hit", "miss")) - lookups >= 10
    assert v.counter(v.metrics.bad_payloads, reason="bad_tensor") == bad


def test_32_concurrent_streams_complete(world):
    v = world.verifier
    batch = prompts(32, seed=8)
    results = generate_all(v, batch, max_tokens=12)
    for (ids, _, complete), want in zip(results, greedy_reference(world.checkpoint, batch, 12), strict=True):
        assert complete.finish_reason == pb.FINISH_REASON_LENGTH and ids == want
    info = v.info()
    assert (info.num_running, info.num_waiting, info.free_slots) == (0, 0, info.max_slots)


def poll(condition, timeout: float = 30, what: str = "condition"):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_cancelling_half_frees_their_slots_on_both_services(world):
    v, d = world.verifier, world.drafter
    gauge = d.metrics.num_requests
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=120, ignore_eos=True))
    calls = []
    for prompt in prompts(8, seed=9):
        request.token_ids.ids[:] = prompt[:6]
        calls.append(v.stub.Generate(request, timeout=120))
    for call in calls:
        assert next(call).WhichOneof("event") == "chunk"
    poll(lambda: v.info().num_running == 8 and gauge._value.get() == 8, what="8 requests on both services")
    for call in calls[:4]:
        call.cancel()
    poll(lambda: v.info().num_running == 4 and gauge._value.get() == 4, what="4 cancelled requests freed")
    assert v.info().free_slots == v.info().max_slots - 4
    assert v.counter(v.metrics.requests_finished, finish_reason="abort") >= 4
    for call in calls[4:]:
        assert list(call)[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
    poll(lambda: v.info().num_running == 0 and gauge._value.get() == 0, what="everything freed")


def test_abort_rpc_ends_the_stream_with_abort(world):
    v = world.verifier
    request = pb.GenerateRequest(request_id="to-abort", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 sampling=pb.SamplingParams(max_tokens=140, ignore_eos=True))
    call = v.stub.Generate(request, timeout=60)
    assert next(call).WhichOneof("event") == "chunk"
    assert v.stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    assert list(call)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    assert not v.stub.Abort(pb.AbortRequest(request_id="to-abort")).found


@pytest.mark.parametrize(("case", "code", "words"), [
    ({"sampling": {"temperature": -1.0}}, pb.ERROR_CODE_INVALID_ARGUMENT, "temperature"),
    ({"sampling": {"temperature": float("nan")}}, pb.ERROR_CODE_INVALID_ARGUMENT, "temperature"),
    ({"sampling": {"top_p": 1.5}}, pb.ERROR_CODE_INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    ({"sampling": {"top_k": VOCAB + 1}}, pb.ERROR_CODE_INVALID_ARGUMENT, "top_k"),
    ({"sampling": {"max_tokens": 0}}, pb.ERROR_CODE_INVALID_ARGUMENT, "max_tokens must be >= 1"),
    ({"sampling": {"seed": -5}}, pb.ERROR_CODE_INVALID_ARGUMENT, "seed"),
    ({"sampling": {"stop": [""]}}, pb.ERROR_CODE_INVALID_ARGUMENT, "stop"),
    ({"text": ""}, pb.ERROR_CODE_INVALID_ARGUMENT, "prompt is empty"),
    ({"token_ids": {"ids": []}}, pb.ERROR_CODE_INVALID_ARGUMENT, "prompt is empty"),
    ({"token_ids": {"ids": [5, VOCAB]}}, pb.ERROR_CODE_INVALID_ARGUMENT, f"token id {VOCAB} out of range"),
    ({"token_ids": {"ids": [5]}, "chat": True}, pb.ERROR_CODE_INVALID_ARGUMENT, "chat needs a text prompt"),
    ({"token_ids": {"ids": [5] * MAX_CONTEXT}}, pb.ERROR_CODE_RESOURCE_EXHAUSTED, "does not fit the context"),
])
def test_malformed_requests_get_a_clear_in_band_error(world, case, code, words):
    request = pb.GenerateRequest(**({"text": "hello"} | case))
    responses = list(world.verifier.stub.Generate(request, timeout=30))
    assert len(responses) == 1 and responses[0].WhichOneof("event") == "error"
    assert responses[0].error.code == code
    assert words in responses[0].error.message


def test_duplicate_request_id_is_refused_and_the_server_stays_up(world):
    v = world.verifier
    request = pb.GenerateRequest(request_id="twice", token_ids=pb.TokenIds(ids=[9, 10]),
                                 sampling=pb.SamplingParams(max_tokens=100, ignore_eos=True))
    first = v.stub.Generate(request, timeout=60)
    assert next(first).WhichOneof("event") == "chunk"
    second = list(v.stub.Generate(request, timeout=30))
    assert second[0].error.code == pb.ERROR_CODE_ALREADY_EXISTS and "twice" in second[0].error.message
    first.cancel()
    assert v.generate([9, 10], max_tokens=4)[0] == greedy_reference(world.checkpoint, [[9, 10]], 4)[0]


def test_drafter_killed_mid_generation_then_restarted(world):
    loop, checkpoint = world.loop, world.checkpoint
    drafter = Drafter(loop, checkpoint, world.tokenizer.fingerprint)
    v = Verifier(loop, checkpoint, world.tokenizer, drafter.port, step_timeout=2.0)
    try:
        v.wait_connected()
        drafted = v.metrics.num_draft_tokens  # verified drafts: the tables hit
        batch = prompts(6, seed=11)
        with ThreadPoolExecutor(len(batch)) as pool:
            futures = [pool.submit(v.generate, p, max_tokens=60) for p in batch]
            poll(lambda: drafted._value.get() > 0, what="speculation to start")
            drafter.kill()
            results = [f.result() for f in futures]
        for (ids, _, complete), want in zip(results, greedy_reference(checkpoint, batch, 60), strict=True):
            assert complete.finish_reason == pb.FINISH_REASON_LENGTH and ids == want
        assert not v.info().speculation.drafter_connected
        assert v.counter(v.metrics.fallback_steps, reason="down") > 0

        restarted = Drafter(loop, checkpoint, world.tokenizer.fingerprint, port=drafter.port)
        v.wait_connected()
        before = drafted._value.get()
        batch = prompts(4, seed=12)
        results = generate_all(v, batch, max_tokens=20)
        assert [r[0] for r in results] == greedy_reference(checkpoint, batch, 20)
        assert drafted._value.get() > before, "speculation did not resume after the drafter restarted"
        restarted.kill()
    finally:
        v.close()


class GarbageDrafter(DrafterService):
    """A real drafter that corrupts its answers, one kind of garbage per proposal, in turn."""

    MODES = ("too_many_drafts", "token_out_of_vocab", "kind_unspecified", "unknown_id", "nan", "wrong_dtype",
             "wrong_shape", "dense_wrong_vocab")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn = 0

    def run_step(self, stream, owned, step, features=None, draft=True):
        result = super().run_step(stream, owned, step, features, draft)
        for proposal in result.proposals:
            self.corrupt(proposal)
        return result

    def corrupt(self, p: dpb.Proposal) -> None:
        mode = self.MODES[self.turn % len(self.MODES)]
        self.turn += 1
        sparse = p.probs_kind == dpb.PROBS_KIND_SPARSE
        if mode == "too_many_drafts":
            p.draft_token_ids.extend([7] * (K + 1))
        elif mode == "token_out_of_vocab":
            p.draft_token_ids[0] = VOCAB + 5
        elif mode == "kind_unspecified":
            p.probs_kind = dpb.PROBS_KIND_UNSPECIFIED
        elif mode == "unknown_id":
            p.request_id = "nobody-asked"
        elif mode == "nan" and sparse:
            p.sparse.values.data = torch.full((len(p.draft_token_ids), 16), float("nan")).numpy().tobytes()
            p.sparse.values.shape[:] = [len(p.draft_token_ids), 16]
        elif mode == "wrong_dtype" and sparse:
            p.sparse.values.dtype = dpb.DTYPE_BFLOAT16
        elif mode == "wrong_shape" and sparse:
            p.sparse.values.shape[:] = [p.sparse.values.shape[1], p.sparse.values.shape[0]]
        elif mode == "dense_wrong_vocab" and sparse:
            p.probs_kind = dpb.PROBS_KIND_DENSE
            n = len(p.draft_token_ids)
            p.probs.CopyFrom(dpb.Tensor(data=torch.full((n, 100), 0.01).numpy().tobytes(),
                                        dtype=dpb.DTYPE_FLOAT32, shape=[n, 100]))
        else:  # the garbage does not apply to this proposal: drop its drafts instead
            del p.draft_token_ids[:]


def test_garbage_from_the_drafter_is_refused_counted_and_falls_back(world):
    loop, checkpoint = world.loop, world.checkpoint
    drafter = Drafter(loop, checkpoint, world.tokenizer.fingerprint, service_class=GarbageDrafter)
    v = Verifier(loop, checkpoint, world.tokenizer, drafter.port)
    try:
        v.wait_connected()
        greedy = prompts(6, seed=13)
        with ThreadPoolExecutor(10) as pool:
            sampled = [pool.submit(v.generate, p, max_tokens=24, temperature=0.8)
                       for p in prompts(4, seed=14)]
            results = list(pool.map(lambda p: v.generate(p, max_tokens=24), greedy))
            sampled = [f.result() for f in sampled]
        assert [r[0] for r in results] == greedy_reference(checkpoint, greedy, 24)
        assert all(len(ids) == 24 and c.finish_reason == pb.FINISH_REASON_LENGTH for ids, _, c in sampled)
        m = v.metrics
        assert v.counter(m.bad_payloads, reason="bad_tensor") >= len(GarbageDrafter.MODES) - 2
        assert v.counter(m.bad_payloads, reason="unknown_request") >= 1
        assert v.counter(m.fallback_steps, reason="bad_payload") >= 1
        assert v.counter(m.num_draft_tokens) == 0, "a corrupted proposal reached the sampler"
        assert v.info().speculation.drafter_connected  # both services are still up
    finally:
        v.close()
        drafter.kill()


def test_handshake_refuses_a_drafter_for_another_tokenizer(world):
    loop, checkpoint = world.loop, world.checkpoint
    drafter = Drafter(loop, checkpoint, "0" * 64)
    v = Verifier(loop, checkpoint, world.tokenizer, drafter.port)
    try:
        poll(lambda: "tokenizer fingerprint" in v.server.scheduler.link.last_error, what="the refusal")
        assert not v.info().speculation.drafter_connected
        assert v.generate([4, 5, 6], max_tokens=8)[0] == greedy_reference(checkpoint, [[4, 5, 6]], 8)[0]
    finally:
        v.close()
        drafter.kill()


@pytest.mark.parametrize("link", ["colocated", "colocated-inline"])
def test_colocated_drafter_gives_the_two_process_output(world, link):
    """Tables on the drafter's worker, serial and just-in-time steps on it too or (inline) on the loop."""
    batch = prompts(8, seed=31)
    two_process = [r[0] for r in generate_all(world.verifier, batch, max_tokens=20)]
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, link)
    try:
        assert v.info().speculation.drafter_connected
        assert [r[0] for r in generate_all(v, batch, max_tokens=20)] == two_process
        assert two_process == greedy_reference(world.checkpoint, batch, 20)
        assert v.counter(v.metrics.cache["hit"]) > 0 and v.counter(v.metrics.num_draft_tokens) > 0
    finally:
        v.close()


def test_colocated_serial_drafting_on_the_loop_equals_target_only(world):
    """Serial drafting (no tables) with every step run on the loop: target-only output, drafts used."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, "colocated-inline", cache_branches=0)
    try:
        greedy_equals_target_only(world, v, 8, seed=37)
        assert v.counter(v.metrics.num_draft_tokens) > 0 and v.counter(v.metrics.cache["hit"]) == 0
    finally:
        v.close()


def record_whole_batches(monkeypatch) -> list[tuple[bool, bool]]:
    """Patches QueuedDrafts.as_batch to record, per call, whether the round took the queued drafts whole (as
    the drafter left them) and whether those carried q (sampled rows)."""
    from specwire.verifier.drafter_link import QueuedDrafts

    calls, as_batch = [], QueuedDrafts.as_batch

    def recording(self, *args):
        out = as_batch(self, *args)
        calls.append((out is not None, out is not None and out.probs is not None))
        return out

    monkeypatch.setattr(QueuedDrafts, "as_batch", recording)
    return calls


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_colocated_drafts_queued_behind_the_sampler_equal_target_only(world, monkeypatch, device):
    """Serial drafting whose drafts are queued on the device behind each sampler (a CPU's, in order, or a
    GPU's, under CUDA graphs and the Triton sampler):
    target-only output with more requests than slots, so rounds mix queued rows with rows just admitted,
    which get their first drafts through a DraftStep. Rounds of the same rows feed the queued drafts to the
    next verification as the drafter left them (QueuedDrafts.as_batch), the others split them per request:
    both happen here."""
    calls = record_whole_batches(monkeypatch)
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, "colocated-inline", cache_branches=0,
                 queue_drafts=True, max_slots=3, device=device)
    try:
        greedy_equals_target_only(world, v, 8, seed=41, device=device)
        queued, drafted = v.counter(v.metrics.queued_drafts), v.counter(v.metrics.num_draft_tokens)
        assert queued > 0 and drafted > 0 and v.counter(v.metrics.cache["hit"]) == 0
        fed_whole = [whole for whole, _ in calls]
        assert any(fed_whole) and not all(fed_whole), fed_whole
        # On CUDA each verification's device time is timed too, within its engine-thread time (the span
        # starts once the drafts it is queued behind are done); a CPU times none.
        sample = v.metrics.registry.get_sample_value
        steps, gpu_steps = (sample(f"specwire_verify_{m}_seconds_count") for m in ("step", "gpu"))
        if device == "cuda":
            assert gpu_steps == steps > 0
            assert 0 < sample("specwire_verify_gpu_seconds_sum") < sample("specwire_verify_step_seconds_sum")
        else:
            assert gpu_steps == 0 and steps > 0
    finally:
        v.close()


@pytest.mark.parametrize("forced_hit_rate", [None, 1.0], ids=["lookups", "forced_hits"])
def test_colocated_tables_ahead_equal_target_only(world, forced_hit_rate):
    """Queued serial drafting with tables ahead (--queued-tables): each round's table is looked up from the
    sampler's output; rounds whose every request hit verify the tables' drafts, the others the serial ones.
    Target-only output either way, also where hits are forced (the drafter then takes a branch whose bonus
    token is not the target's, as a synthetic benchmark does). The bigram head's own hits are too rare for
    a batch of three to hit at once, so the verifier stops asking for tables (TablesAhead)."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, "colocated-inline", cache_branches=0,
                 queue_drafts=True, max_slots=3, queued_tables=4, forced_hit_rate=forced_hit_rate)
    try:
        greedy_equals_target_only(world, v, 8, seed=43)
        hits, misses = v.counter(v.metrics.cache["hit"]), v.counter(v.metrics.cache["miss"])
        served = v.counter(v.metrics.tables_ahead_served)
        assert v.counter(v.metrics.queued_drafts) > 0 and hits + misses > 0, (hits, misses)
        if forced_hit_rate:
            assert hits > 0 and served > 0, (hits, misses, served)
    finally:
        v.close()


@pytest.mark.parametrize("drafting", [{"cache_branches": 0}, {"drafting_epoch": 3}],
                         ids=["serial", "adaptive"])
def test_queued_drafts_lost_to_a_drafter_fault_cost_no_request(world, drafting):
    """Every third take of queued drafts fails inside the drafter (after it committed the tokens): those
    requests verify without drafts and are sent to the drafter whole, and the output stays target-only;
    also where the adaptive mode's serial epochs queue them."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, "colocated-inline", queue_drafts=True,
                 max_slots=3, **drafting)
    proposer = v.server.scheduler.link._take.func.__self__.proposer
    read, takes = proposer._proposal, iter(range(10**6))

    def faulty(*args):
        if next(takes) % 3 == 2:
            raise RuntimeError("injected drafter fault")
        return read(*args)

    proposer._proposal = faulty
    try:
        greedy_equals_target_only(world, v, 8, seed=43)
        assert v.counter(v.metrics.bad_payloads, reason="link_error") > 0
        assert v.counter(v.metrics.queued_drafts) > 0 and v.counter(v.metrics.num_draft_tokens) > 0
    finally:
        v.close()


# With serial and none only (the default where drafts queue), the measured speeds may let so few serial
# rounds run that the tiny head gets none of its drafts accepted (CI, once): there, drafts verified is
# what is asserted; with all three modes, accepted drafts too.
@pytest.mark.parametrize("sampling, device, modes, accepts", [
    ({}, "cpu", DRAFTING_MODES, True),
    ({"temperature": 0.3, "top_p": 0.9, "seed": 779}, "cpu", DRAFTING_MODES, True),
    ({}, "cpu", None, False),
    pytest.param({}, "cuda", DRAFTING_MODES, True, marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
], ids=["greedy", "seeded", "greedy_default_modes", "greedy_cuda"])
def test_adaptive_drafting_queues_its_serial_epochs_exactly(world, sampling, device, modes, accepts):
    """Epochs of three rounds (tables, serial, none, then the fastest, switching back and forth): a serial
    epoch queues its drafts behind the sampler but in its last round, so that whatever mode follows starts
    with none queued. Output stays target-only's, greedy or seeded-sampled, with more requests than slots.
    By default (modes None) the tables take no part where drafts queue. (Table hits are not asserted: how
    many table rounds run follows the measured speed.)"""
    batch = prompts(8, seed=45)
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, "colocated-inline", drafting_epoch=3,
                 queue_drafts=True, max_slots=3, device=device, drafting_modes=modes)
    try:
        results = [r[0] for r in generate_all(v, batch, max_tokens=24, **sampling)]
        if sampling:
            assert results == seeded_reference(world.checkpoint, batch, 24, 0.3, 0.9, 779)
        else:
            assert results == greedy_reference(world.checkpoint, batch, 24, device)
        ran = {m for m in DRAFTING_MODES if v.counter(v.metrics.drafting_rounds[m]) > 0}
        assert ran == set(modes or ("serial", "none")), ran
        serial_rounds = v.counter(v.metrics.drafting_rounds["serial"])
        queued = v.counter(v.metrics.queued_drafts)
        assert 0 < queued <= 3 * serial_rounds, (queued, serial_rounds)  # queued in serial rounds only
        assert v.counter(v.metrics.num_draft_tokens) > 0
        assert v.counter(v.metrics.num_accepted_tokens) > 0 or not accepts
        # none refused: a row the drafter holds with a chain kept (tokens pending) cannot be queued
        assert v.counter(v.metrics.bad_payloads, reason="unknown_request") == 0
        assert v.counter(v.metrics.bad_payloads, reason="link_error") == 0
    finally:
        v.close()


@contextlib.contextmanager
def verifier_of_the_world_drafter(world, **settings):
    """A second verifier, with other settings, connected to the world's drafter."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, world.drafter.port, **settings)
    try:
        v.wait_connected()
        yield v
    finally:
        v.close()


def greedy_equals_target_only(world, v: Verifier, n: int, seed: int, device: str = "cpu") -> list:
    batch = prompts(n, seed=seed)
    results = generate_all(v, batch, max_tokens=20)
    assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 20, device)
    return results


def test_greedy_without_just_in_time_drafts_equals_target_only(world):
    """A request no table had drafts for verifies none that round."""
    with verifier_of_the_world_drafter(world, just_in_time_wait=0.0) as v:
        greedy_equals_target_only(world, v, 8, seed=17)
        assert v.counter(v.metrics.cache["miss"]) > 0 and v.counter(v.metrics.cache["hit"]) > 0
        assert v.counter(v.metrics.just_in_time["declined"]) > 0
        assert v.counter(v.metrics.just_in_time["drafted"]) == 0


def test_just_in_time_drafts_that_come_late_still_get_a_table(world):
    """A round never waits for them (a 1 µs wait), yet the table drafted while it runs covers that request,
    so later rounds hit: a late answer must not leave a request without tables for good."""
    with verifier_of_the_world_drafter(world, just_in_time_wait=1e-6) as v:
        results = greedy_equals_target_only(world, v, 6, seed=19)
        assert v.counter(v.metrics.just_in_time["late"]) > 0
        assert v.counter(v.metrics.cache["hit"]) > 0 and all(r[2].usage.draft_tokens > 0 for r in results)


def test_greedy_with_adaptive_drafting_equals_target_only(world):
    """Epochs of two rounds: tables, then serial, then none (no drafts), then the fastest, switching back and
    forth; the tokens settled in epochs without drafts reach the drafter with the next step."""
    with verifier_of_the_world_drafter(world, drafting_epoch=2) as v:
        greedy_equals_target_only(world, v, 8, seed=21)
        for m in ("tables", "serial", "none"):  # rounds, their time and their tokens (>= 1 a round)
            rounds = v.counter(v.metrics.drafting_rounds[m])
            assert rounds > 0 and v.counter(v.metrics.drafting_seconds[m]) > 0
            assert v.counter(v.metrics.drafting_tokens[m]) >= rounds
        assert v.counter(v.metrics.num_accepted_tokens) > 0 and v.counter(v.metrics.cache["hit"]) > 0
        # Drafted again after the epochs without drafts (a losing mode's retry: 8, then 16 epochs after it
        # last ran), the drafter caught up, not left behind; the output still target-only's.
        drafted = v.counter(v.metrics.num_draft_tokens)
        for seed in range(22, 26):
            greedy_equals_target_only(world, v, 8, seed=seed)
            if v.counter(v.metrics.num_draft_tokens) > drafted:
                break
        assert v.counter(v.metrics.num_draft_tokens) > drafted
        assert v.counter(v.metrics.bad_payloads, reason="unknown_request") == 0


def test_seeded_sampling_with_adaptive_drafting_equals_target_only_sampling(world):
    """Through switches between tables, serial drafting and rounds without drafts, a seeded sampled request
    is still the target-only sample token for token."""
    batch = prompts(6, seed=27)
    sampling = {"temperature": 0.3, "top_p": 0.9, "seed": 777}
    with verifier_of_the_world_drafter(world, drafting_epoch=2) as v:
        results = generate_all(v, batch, max_tokens=24, **sampling)
        assert [r[0] for r in results] == seeded_reference(world.checkpoint, batch, 24, 0.3, 0.9, 777)
        assert all(v.counter(v.metrics.drafting_rounds[m]) > 0 for m in ("tables", "serial", "none"))


def test_greedy_with_serial_drafting_equals_target_only(world):
    with verifier_of_the_world_drafter(world, cache_branches=0) as v:
        greedy_equals_target_only(world, v, 8, seed=15)
        assert v.counter(v.metrics.num_accepted_tokens) > 0


@pytest.mark.parametrize("bounded", ["verifier", "drafter"])
def test_steps_stay_under_the_message_limit_prompts_waiting_their_turn(world, bounded):
    """Prompts whose features pass a message bound together go over a few a step (whole requests, 3/4 of the
    bound for features); one that alone would pass it is never drafted. The bound is the verifier's own
    (its channel's) or the drafter's (it says it in the handshake), whichever is smaller. Before, such a step
    failed, the stream broke, every request was re-sent whole, and it broke again (the 8B shape at batch 32:
    130 MB of prompt features against 64 MiB). Output stays target-only's; no stream breaks."""
    bound = 40 * (4 * H) * 4 // 3  # 3/4 of it: 40 tokens' float32 features a step
    batch = [p[:1] * 16 for p in prompts(6, seed=23)] + [prompts(1, seed=24)[0][:1] * 60]
    drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint,
                      **({"max_message_bytes": bound} if bounded == "drafter" else {}))
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, drafter.port, cache_branches=0,
                 **({"max_message_bytes": bound} if bounded == "verifier" else {}))
    try:
        v.wait_connected()
        results = generate_all(v, batch, max_tokens=20)
        assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 20)
        assert all(r[2].usage.draft_tokens > 0 for r in results[:6])  # 15 rows each: two a step
        assert results[6][2].usage.draft_tokens == 0  # 59 rows: never fits the 40 a step may carry
        assert v.counter(v.metrics.fallbacks["down"]) == 0
    finally:
        v.close()
        drafter.kill()


def test_target_only_rounds_on_the_worker_hand_back_for_news(world):
    """Without a drafter the engine thread runs round after round on its own: the output is still the
    target's, a request that comes meanwhile is admitted at once (it ends while a long one still runs), and an
    abort ends the long one's stream."""
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, None)
    try:
        greedy_equals_target_only(world, v, 8, seed=23)
        request = pb.GenerateRequest(request_id="long", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     sampling=pb.SamplingParams(max_tokens=140, ignore_eos=True))
        call = v.stub.Generate(request, timeout=60)
        assert next(call).WhichOneof("event") == "chunk"
        ids, _, complete = v.generate([8, 9, 10], max_tokens=4)
        assert len(ids) == 4 and complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert v.stub.Abort(pb.AbortRequest(request_id="long")).found  # it was still generating
        assert list(call)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    finally:
        v.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_services_greedy_equals_target_only(world):
    """Drafter on the first GPU, verifier on the last: CUDA graphs (decode and drafting), the Triton
    sampler, features crossing devices. float32 weights so that greedy ties cannot differ."""
    gpus = torch.cuda.device_count()
    drafter = Drafter(world.loop, world.checkpoint, world.tokenizer.fingerprint, device="cuda:0")
    v = Verifier(world.loop, world.checkpoint, world.tokenizer, drafter.port, device=f"cuda:{gpus - 1}")
    try:
        v.wait_connected()
        batch = prompts(20, seed=16)
        results = generate_all(v, batch, max_tokens=24)
        assert [r[0] for r in results] == greedy_reference(world.checkpoint, batch, 24, f"cuda:{gpus - 1}")
        assert v.counter(v.metrics.num_accepted_tokens) > 0
        assert v.counter(v.metrics.forward_steps, mode="cuda_graph") > 0
    finally:
        v.close()
        drafter.kill()
