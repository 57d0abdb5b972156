"""`specwire client`: stream a completion from a running verifier over gRPC."""

import argparse
import json
import sys
import time
import uuid

import grpc

from specwire import grpc_common
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                   pb.FINISH_REASON_ABORT: "abort"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = grpc_common.env_default
    parser.add_argument("--server", default=env("SPECWIRE_SERVER", "127.0.0.1:50051"),
                        help="verifier HOST:PORT (env SPECWIRE_SERVER)")
    parser.add_argument("--prompt", default=None, help="prompt text (required unless --messages is given)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", default=None,
                        help="a system message before the prompt (implies --chat; default: none)")
    parser.add_argument("--messages", default=None, metavar="FILE",
                        help='a conversation as a JSON list of {"role": "system|user|assistant", "content": '
                             "TEXT} objects, rendered with the model's chat template; '-' reads stdin")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold (off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    parser.add_argument("--seed", type=int, default=None, help="seed for a repeatable sampled output")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--token", default=env("SPECWIRE_TOKEN", None),
                        help="bearer token (env SPECWIRE_TOKEN)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up on the call")
    grpc_common.add_channel_arguments(parser)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, stop=args.stop,
                                 ignore_eos=args.ignore_eos)
    for field in ("top_p", "seed", "max_tokens"):
        if getattr(args, field) is not None:
            setattr(sampling, field, getattr(args, field))
    request = pb.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sampling)
    messages = chat_messages(args)
    if messages is None:
        request.text, request.chat = args.prompt, args.chat
    else:
        turns = (pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        request.messages.messages.extend(turns)
    return request


def chat_messages(args: argparse.Namespace) -> list[dict] | None:
    """The conversation to send as `messages`, or None for a plain `text` prompt; ValueError if malformed."""
    if args.messages is not None:
        if args.prompt is not None or args.system is not None:
            raise ValueError("--messages holds the whole conversation: drop --prompt and --system")
        raw = sys.stdin.read() if args.messages == "-" else _read_text(args.messages)
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--messages is not JSON: {e}") from None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError('--messages must be a JSON list of {"role": str, "content": str} objects')
        return messages
    if args.prompt is None:
        raise ValueError("give --prompt TEXT or --messages FILE")
    if args.system is not None:
        return [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    return None


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read --messages {path}: {e.strerror}") from None


def summary(text: str, token_ids: list[int], complete: pb.Complete, seconds: float) -> dict:
    """The --json object; `seconds` is the client's wall time, so tokens_per_s is what the caller saw."""
    usage = complete.usage
    stats = {"tokens": len(token_ids), "seconds": seconds,
             "tokens_per_s": len(token_ids) / seconds if seconds > 0 else 0.0,
             "prompt_tokens": usage.prompt_tokens, "server_seconds": usage.seconds,
             "time_to_first_token_seconds": usage.time_to_first_token_seconds}
    if usage.speculative:
        stats |= {"drafts": usage.drafts, "draft_tokens": usage.draft_tokens,
                  "accepted_tokens": usage.accepted_tokens,
                  "mean_acceptance_length": usage.mean_acceptance_length}
    finish = _FINISH_REASONS.get(complete.finish_reason, "unknown")
    return {"text": text, "token_ids": token_ids, "finish_reason": finish, "stats": stats}


async def _generate(args: argparse.Namespace, request: pb.GenerateRequest) -> int:
    text, token_ids = [], []
    start = time.perf_counter()
    async with grpc_common.create_channel(args.server, grpc_common.ChannelOptions.from_args(args)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, metadata=grpc_common.auth_metadata(args.token), timeout=args.timeout)
        async for response in call:
            event = response.WhichOneof("event")
            if event == "chunk":
                token_ids.extend(response.chunk.token_ids)
                text.append(response.chunk.text)
                if not args.json:
                    sys.stdout.write(response.chunk.text)
                    sys.stdout.flush()
            elif event == "error":
                code = pb.ErrorCode.Name(response.error.code).removeprefix("ERROR_CODE_")
                print(f"specwire client: {code}: {response.error.message}", file=sys.stderr)
                return 1
            else:
                result = summary("".join(text), token_ids, response.complete, time.perf_counter() - start)
                print(json.dumps(result) if args.json else f"\n{_stats_line(result)}",
                      file=sys.stdout if args.json else sys.stderr)
                return 0
    print("specwire client: the stream ended without a Complete message", file=sys.stderr)
    return 1


def _stats_line(result: dict) -> str:
    stats = result["stats"]
    line = f"[{stats['tokens']} tokens, {stats['seconds']:.2f} s, {stats['tokens_per_s']:.1f} tok/s"
    if "mean_acceptance_length" in stats:
        line += f", mean acceptance length {stats['mean_acceptance_length']:.2f}"
    return f"{line}, {result['finish_reason']}]"


def run(args: argparse.Namespace) -> int:
    try:
        request = build_request(args)  # bad flags fail here, before any connection
    except ValueError as e:
        print(f"specwire client: error: {e}", file=sys.stderr)
        return 2
    try:
        return grpc_common.run(_generate(args, request))
    except grpc.aio.AioRpcError as e:
        print(f"specwire client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the channel cancels the call, which frees the server's slot
        return 130
