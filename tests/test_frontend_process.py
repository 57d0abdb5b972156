"""The verifier split in two processes (`specwire verifier --frontend process`): a real `specwire
verifier-frontend` process serves the client streams and relays them over the core socket to the scheduler,
which runs here with the tiny target and the bigram drafter of test_services_e2e.py over real gRPC.

What a client sees must not change: greedy and seeded output equal to target-only decoding, the same in-band
errors, Abort, cancels that free their slots, GetModelInfo; and either process going away costs the other
nothing but its requests.
"""

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from specwire.verifier import frontend
from specwire.verifier.core_socket import SplitVerifier
from specwire.verifier.server import VerifierSettings
from test_services_e2e import (
    MAX_CONTEXT,
    VOCAB,
    Loop,
    generate_all,
    greedy_equals_target_only,
    greedy_reference,
    poll,
    prompts,
    seeded_reference,
    serving,
    tiny_target,
    world_of,
)

from specwire import grpc_common
from specwire.commands.demo import Service, free_port, start, stop, wait_serving
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def world():
    yield from world_of(frontend="process")


def test_greedy_through_the_front_end_process_equals_target_only(world):
    v = world.verifier
    accepted_before = v.counter(v.metrics.num_accepted_tokens)
    results = greedy_equals_target_only(world, v, 20, seed=0)
    assert all(text == world.tokenizer.decode(ids) for ids, text, _ in results)  # made by the front-end
    assert all(complete.finish_reason == pb.FINISH_REASON_LENGTH for _, _, complete in results)
    usage = [complete.usage for _, _, complete in results]
    accepted = sum(u.accepted_tokens for u in usage)
    assert 0 < accepted < sum(u.draft_tokens for u in usage)  # speculation ran, and its rejections
    # The Complete is made after the round's drafts are counted: the usage adds up to the core's metrics.
    assert v.counter(v.metrics.num_accepted_tokens) - accepted_before == accepted
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(len(p), 20) for p in prompts(20, 0)]


def test_seeded_sampling_through_the_front_end_equals_target_only_sampling(world):
    batch = prompts(6, seed=17)
    sampling = {"temperature": 0.3, "top_p": 0.9, "seed": 4321}
    results = generate_all(world.verifier, batch, max_tokens=20, **sampling)
    assert [r[0] for r in results] == seeded_reference(world.checkpoint, batch, 20, 0.3, 0.9, 4321)


def test_model_info_is_the_cores(world):
    v = world.verifier
    info = v.info()
    assert (info.model_name, info.vocab_size, info.max_context) == ("tiny", VOCAB, MAX_CONTEXT)
    assert info.speculation.drafter_connected and info.speculation.num_speculative_tokens == 3
    assert (info.num_running, info.free_slots) == (0, v.engine.max_slots)


@pytest.mark.parametrize(("case", "code", "words"), [
    ({"sampling": {"temperature": -1.0}}, pb.ERROR_CODE_INVALID_ARGUMENT, "temperature"),
    ({"token_ids": {"ids": [5, VOCAB]}}, pb.ERROR_CODE_INVALID_ARGUMENT, f"token id {VOCAB} out of range"),
    ({"token_ids": {"ids": [5] * MAX_CONTEXT}}, pb.ERROR_CODE_RESOURCE_EXHAUSTED, "does not fit the context"),
    ({"messages": {"messages": [{"role": "robot", "content": "hi"}]}}, pb.ERROR_CODE_INVALID_ARGUMENT,
     "messages[0].role is 'robot'"),
])
def test_the_cores_refusals_reach_the_client_in_band(world, case, code, words):
    request = pb.GenerateRequest(request_id=f"bad-{code}-{words[:8]}", **({"text": "hello"} | case))
    responses = list(world.verifier.stub.Generate(request, timeout=30))
    assert len(responses) == 1 and responses[0].error.code == code
    assert words in responses[0].error.message and responses[0].request_id == request.request_id


def test_duplicate_request_id_cancel_and_abort(world):
    v = world.verifier
    long = pb.SamplingParams(max_tokens=120, ignore_eos=True)
    first = v.stub.Generate(pb.GenerateRequest(request_id="twice", token_ids=pb.TokenIds(ids=[9, 10]),
                                               sampling=long), timeout=60)
    assert next(first).WhichOneof("event") == "chunk"
    second = list(v.stub.Generate(pb.GenerateRequest(request_id="twice", text="hi"), timeout=30))
    assert second[0].error.code == pb.ERROR_CODE_ALREADY_EXISTS and "twice" in second[0].error.message
    aborted = v.stub.Generate(pb.GenerateRequest(request_id="to-abort", token_ids=pb.TokenIds(ids=[5, 6]),
                                                 sampling=long), timeout=60)
    assert next(aborted).WhichOneof("event") == "chunk"
    assert v.stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    assert list(aborted)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    assert not v.stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    first.cancel()  # the client goes: the core frees the slot
    poll(lambda: v.info().num_running == 0, what="the cancelled request freed")
    assert v.info().free_slots == v.info().max_slots
    assert v.generate([9, 10], max_tokens=4)[0] == greedy_reference(world.checkpoint, [[9, 10]], 4)[0]


def _channel(port: int, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    target = f"127.0.0.1:{port}"
    return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


@contextlib.contextmanager
def _served(bare, credentials: grpc.ChannelCredentials | None = None, **server_options):
    """A split target-only verifier on the tiny model, its front-end a real process: (core, stub), the stub's
    channel made with `credentials`. server_options: more ServerOptions (TLS, token)."""
    port = free_port()
    options = grpc_common.ServerOptions(listen=f"127.0.0.1:{port}", grace_seconds=30, **server_options)
    engine = TargetEngine(checkpoint=bare.checkpoint, device="cpu", max_slots=4, max_context=MAX_CONTEXT)
    split = SplitVerifier(options, VerifierSettings(model_name="tiny"), VerifierMetrics(),
                          frontend.command(options, "INFO", "text"))

    try:
        bare.loop.run(split.start(engine, bare.tokenizer, None, "tiny"))
        with _channel(port, credentials) as channel:
            poll(lambda: serving(channel), timeout=60, what="SERVING")
            yield split, generation_pb2_grpc.GenerationStub(channel)
    finally:
        bare.loop.run(split.close())


def _long_request(stub, request_id: str, metadata=()):
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[4, 5, 6]),
                                 sampling=pb.SamplingParams(max_tokens=150, ignore_eos=True))
    call = stub.Generate(request, timeout=120, metadata=metadata)
    assert next(call).WhichOneof("event") == "chunk"
    return call


@pytest.fixture(scope="module")
def bare():
    loop = Loop()
    yield type("Bare", (), dict(loop=loop, checkpoint=tiny_target(),
                                tokenizer=load_tokenizer(default_model_path())))
    loop.close()


def test_core_gone_ends_the_streams_unavailable_and_the_front_end_exits(bare):
    with _served(bare) as (split, stub):
        call = _long_request(stub, "orphan")
        bare.loop.run(split._server.close())  # the core's end of the socket goes, as when it dies
        last = list(call)[-1]
        assert last.error.code == pb.ERROR_CODE_UNAVAILABLE and "core has gone" in last.error.message
        assert bare.loop.run(split.process.wait(), timeout=30) == 1


def test_front_end_killed_frees_its_requests_on_the_core(bare):
    with _served(bare) as (split, stub):
        calls = [_long_request(stub, f"r{i}") for i in range(3)]
        assert len(split.scheduler.running) == 3
        split.process.kill()
        for call in calls:
            with pytest.raises(grpc.RpcError):
                list(call)
        poll(lambda: not split.scheduler.running and not split.scheduler.requests, what="requests aborted")
        assert split.scheduler.engine.num_free_slots == 4


def test_drain_lets_in_flight_streams_finish_and_exits_0(bare):
    with _served(bare) as (split, stub):
        call = _long_request(stub, "in-flight")
        split.drain()  # SIGTERM to the front-end, as the core forwards it
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError):  # new calls are refused once draining
            list(stub.Generate(pb.GenerateRequest(text="late"), timeout=10))
        responses = list(call)
        assert responses[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.chunk.token_ids) for r in responses) == 150 - 1  # the first came before
        assert bare.loop.run(split.process.wait(), timeout=30) == 0


def test_the_token_guards_the_front_end(bare):
    with _served(bare, token="s3cret") as (split, stub):
        assert "s3cret" not in " ".join(frontend.command(split.options, "INFO", "text")[0])  # not in argv
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        _long_request(stub, "with-token", metadata=grpc_common.auth_metadata("s3cret")).cancel()


def test_the_cli_split_verifier_gives_generates_greedy_tokens(tmp_path):
    """`specwire verifier --frontend process` on the default model: the tokens of `specwire generate`, and
    SIGTERM drains both processes to exit 0."""
    prompt, max_tokens = "what a split verifier streams", 12
    generate = [sys.executable, "-m", "specwire", "generate", "--device", "cpu", "--prompt", prompt,
                "--max-tokens", str(max_tokens), "--json"]
    reference = json.loads(subprocess.run(generate, capture_output=True, text=True, timeout=120,
                                          check=True).stdout)
    command = ["verifier", "--device", "cpu", "--k", "0", "--frontend", "process"]
    verifier: Service = start("verifier", command, tmp_path)
    try:
        wait_serving([verifier], timeout=120)
        client = [sys.executable, "-m", "specwire", "client", "--server", f"127.0.0.1:{verifier.port}",
                  "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"]
        done = subprocess.run(client, capture_output=True, text=True, timeout=120, check=True)
        got = json.loads(done.stdout)
        assert got["token_ids"] == reference["token_ids"] and got["text"] == reference["text"]
        verifier.process.send_signal(signal.SIGTERM)
        assert verifier.process.wait(timeout=60) == 0
        log = verifier.log.read_text()
        assert "front-end started" in log and "verifier core ready" in log and "front-end ready" in log
    finally:
        stop([verifier])


def test_a_stream_behind_catches_up_in_one_write_and_keeps_its_end_apart():
    async def read() -> list[pb.GenerateResponse]:
        stream = frontend.Responses()
        for ids, text in (([1], "a"), ([2, 3], "bc"), ([4], "d")):
            stream.put(pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=ids, text=text)))
        stream.put(pb.GenerateResponse(request_id="r", complete=pb.Complete()))
        first, last = await stream.next(), await stream.next()
        waiter = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing waiting: it waits for the next response
        stream.put(pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=[5])))
        return [first, last, await waiter]

    first, last, late = asyncio.run(read())
    assert (list(first.chunk.token_ids), first.chunk.text) == ([1, 2, 3, 4], "abcd")
    assert last.WhichOneof("event") == "complete"
    assert list(late.chunk.token_ids) == [5]


def test_mutual_tls_reaches_the_front_end(bare, pki):
    """The core's TLS flags become the front-end's: a client with a cert of the trusted CA is served, a
    plaintext one is not."""
    (ca, _), (cert, key), (client_cert, client_key) = pki["ca"], pki["server"], pki["client"]
    credentials = grpc_common.channel_credentials(ca, client_cert, client_key)
    with _served(bare, credentials, tls_cert=cert, tls_key=key, tls_client_ca=ca) as (split, stub):
        _long_request(stub, "over-mtls").cancel()
        port = int(split.options.listen.rsplit(":", 1)[1])
        with _channel(port) as plaintext, pytest.raises(grpc.RpcError):
            generation_pb2_grpc.GenerationStub(plaintext).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


def test_stop_strings_are_the_cores_and_the_rest_of_the_text_the_front_ends(world):
    """The front-end detokenises requests without stop strings; one with stop strings gets its text (cut at
    the stop string) from the core, which needs it to stop."""
    v, prompt = world.verifier, prompts(1, seed=31)[0]
    ids, text, complete = v.generate(prompt, max_tokens=24)
    assert text == world.tokenizer.decode(ids) and complete.matched_stop == ""
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another seed: {text!r}"
    _, cut, stopped = v.generate(prompt, max_tokens=24, stop=[stop])
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.matched_stop == stop
    assert cut == text[:text.find(stop)]


def test_a_decoding_tokenizer_from_json_decodes_as_the_models():
    tokenizer = load_tokenizer(default_model_path())
    decoding = Tokenizer.for_decoding(tokenizer.backend.to_str())
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        ids = torch.randint(0, tokenizer.vocab_size, (int(torch.randint(1, 40, (1,), generator=g)),),
                            generator=g).tolist()
        assert decoding.decode(ids) == tokenizer.decode(ids)
    assert decoding.vocab_size == tokenizer.vocab_size and decoding.fingerprint == tokenizer.fingerprint


def test_the_front_ends_text_holds_a_split_character_until_it_is_whole():
    """A character split across tokens (the coffee cup is three byte tokens): the chunks before its last
    byte carry no text for it; a stream that ends inside it gets what is left in a chunk of its own before the
    Complete, as the core's flush gives it."""
    tokenizer = load_tokenizer(default_model_path())
    decoding = Tokenizer.for_decoding(tokenizer.backend.to_str())
    ids = tokenizer.encode("naïve café ☕")

    async def read(pieces: list[int]) -> list[tuple[str, str]]:
        stream, seen = frontend.Responses(IncrementalDetokenizer(decoding)), []
        for piece in pieces:
            stream.put(pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=[piece])))
            seen.append(("chunk", (await stream.next()).chunk.text))
        stream.put(pb.GenerateResponse(request_id="r", complete=pb.Complete()))
        while (response := await stream.next()).WhichOneof("event") == "chunk":
            seen.append(("flush", response.chunk.text))
        return [*seen, ("complete", "")]

    whole = asyncio.run(read(ids))
    assert [text for _, text in whole[-4:-1]] == ["", "", " ☕"] and whole[-1][0] == "complete"
    assert "".join(text for _, text in whole) == tokenizer.decode(ids) == "naïve café ☕"
    cut = asyncio.run(read(ids[:-1]))
    assert cut[-2][0] == "flush" and cut[-2][1] == tokenizer.decode(ids[:-1])[len("naïve café"):]
    assert "".join(text for _, text in cut) == tokenizer.decode(ids[:-1])
