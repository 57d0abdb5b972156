"""`specwire drafter`: serve EAGLE drafts for a target model over gRPC (the Drafter service)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from specwire import grpc_common

DEFAULT_HEAD = Path(__file__).resolve().parent / "heads" / "smollm2-135m-eagle"

log = logging.getLogger("specwire.drafter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = grpc_common.env_default
    grpc_common.add_server_arguments(parser, default_listen="0.0.0.0:50052")
    parser.add_argument("--step-socket", default=env("SPECWIRE_STEP_SOCKET", None), metavar="PATH",
                        help="also serve the per-round Draft stream on this Unix socket (owner-only), for a "
                             "verifier on this host started with --drafter-socket PATH: it skips gRPC's "
                             "per-message cost; the handshake stays on gRPC (env SPECWIRE_STEP_SOCKET)")
    parser.add_argument("--no-shared-features", action="store_true",
                        default=env("SPECWIRE_NO_SHARED_FEATURES", False),
                        help="do not map a verifier's feature table from GPU memory (CUDA IPC, a verifier on "
                             "this host whose GPU this process can see); its features then come as bytes in "
                             "the steps (env SPECWIRE_NO_SHARED_FEATURES)")
    grpc_common.add_model_arguments(parser, dtype_of="head weights and cache")
    add_proposer_arguments(parser)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="draft eagerly")
    parser.add_argument("--metrics-port", type=int, default=env("SPECWIRE_METRICS_PORT", None),
                        help="serve Prometheus /metrics on this port (env SPECWIRE_METRICS_PORT)")
    grpc_common.add_logging_arguments(parser)


def add_proposer_arguments(parser: argparse.ArgumentParser) -> None:
    """The head and the proposer's sizes (the co-located verifier takes them too)."""
    env = grpc_common.env_default
    parser.add_argument("--head", default=env("SPECWIRE_HEAD", None),
                        help="EAGLE head directory, or 'random' (random weights of the target's shape; the "
                             f"default for synthetic:NAME models, else the shipped {DEFAULT_HEAD.name})")
    parser.add_argument("--max-requests", type=int, default=env("SPECWIRE_MAX_REQUESTS", 64),
                        help="requests held at once, over all verifiers (default 64)")
    parser.add_argument("--max-drafts", type=int, default=env("SPECWIRE_MAX_DRAFTS", 8),
                        help="most draft tokens per request per step (default 8)")
    parser.add_argument("--max-branches", type=int, default=env("SPECWIRE_MAX_BRANCHES", 8),
                        help="most branches per request of a speculation-cache table; each holds a KV "
                             "slot (default 8; 0 = drafts only for settled tokens)")
    parser.add_argument("--max-top-k", type=int, default=env("SPECWIRE_MAX_TOP_K", 64),
                        help="widest top-K of sampled drafts (default 64)")
    parser.add_argument("--max-context", type=int, default=env("SPECWIRE_MAX_CONTEXT", 2048),
                        help="head KV-cache positions per request (default 2048)")
    add_min_confidence_argument(parser)


def add_min_confidence_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-confidence", type=float,
                        default=grpc_common.env_default("SPECWIRE_MIN_CONFIDENCE", 0.0),
                        help="dynamic draft length (EAGLE-2's depth rule): stop a chain before the first "
                             "draft after its first whose step's top probability is below this; k is then a "
                             "maximum (env SPECWIRE_MIN_CONFIDENCE; default 0 = off)")


def load_proposer(args: argparse.Namespace):
    """(proposer, target config, tokenizer fingerprint, head name) from the flags."""
    from specwire.engine import device_and_dtype  # torch loads here, once the flags are valid
    from specwire.model_source import load_model
    from specwire.synthetic import head_or_random

    device, dtype = device_and_dtype(args.device, args.dtype)
    config, shared, tokenizer, _ = load_model(args.model, device, dtype,  # only what the head shares
                                              names=("model.embed_tokens.weight", "lm_head.weight"))
    args.head = head_or_random(args.model, args.head)
    proposer, head = build_proposer(args, config, shared)
    return proposer, config, tokenizer.fingerprint, head


def build_proposer(args: argparse.Namespace, config, target_weights: dict):
    """(EagleProposer, head name) on the target's shared tensors, sized by args.head, .device, .dtype,
    .no_cuda_graphs, .min_confidence and the --max-* flags of add_proposer_arguments."""
    from specwire.drafter.eagle_head import load_eagle_head, random_eagle_head
    from specwire.drafter.proposer import EagleProposer

    from specwire.engine import device_and_dtype
    from specwire.errors import ModelLoadError
    from specwire.model import pack_for_cpu
    from specwire.synthetic import RANDOM_HEAD

    head_path = Path(args.head) if args.head else DEFAULT_HEAD
    if args.head != RANDOM_HEAD and not (head_path / "config.json").is_file():
        raise ModelLoadError(f"no EAGLE head at {head_path} (train one with `specwire train-eagle` or pass "
                             "--head)")
    device, dtype = device_and_dtype(args.device, args.dtype)
    # The head shares the target's embedding and lm_head; the rest of the target is not needed here.
    shared = {k: v for k, v in target_weights.items() if k in ("model.embed_tokens.weight", "lm_head.weight")}
    if args.head == RANDOM_HEAD:
        head = random_eagle_head(config, shared, dtype, device, args.max_context)
    else:
        head = load_eagle_head(head_path, config, shared, dtype=dtype, device=device,
                               max_positions=args.max_context)
    pack_for_cpu(head)  # inference only: fp32 CPU linears through oneDNN (specwire.model.Linear)
    proposer = EagleProposer(head, max_requests=args.max_requests, max_context=args.max_context,
                             max_drafts=args.max_drafts, max_top_k=min(args.max_top_k, head.vocab_size),
                             cuda_graphs=not args.no_cuda_graphs, max_branches=args.max_branches,
                             uniform_outcomes=args.head == RANDOM_HEAD, min_confidence=args.min_confidence)
    return proposer, f"{head.config.arch}:{head_path.name}"


async def serve(args: argparse.Namespace) -> None:
    from specwire.drafter.server import DrafterService

    from specwire import step_socket
    from specwire.metrics import DrafterMetrics
    from specwire.v1 import drafter_pb2_grpc

    metrics = DrafterMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    server = grpc_common.GrpcServer(grpc_common.ServerOptions.from_args(args))
    service = DrafterService(metrics, server.draining, server.options.max_message_bytes,
                             shared_features=not args.no_shared_features)
    server.add_service(grpc_common.DRAFTER_SERVICE, drafter_pb2_grpc.add_DrafterServicer_to_server, service)

    async def load() -> None:
        proposer, config, fingerprint, head = await asyncio.to_thread(load_proposer, args)
        service.load(proposer, config, fingerprint, head)
        await server.set_serving(True)
        log.info("drafter ready", extra={"head": head, "device": str(proposer.device)})

    sockets = await step_socket.serve(args.step_socket, service.serve_socket) if args.step_socket else None
    try:
        await server.serve_forever(on_ready=load)
    finally:
        if sockets is not None:
            sockets.close()
            Path(args.step_socket).unlink(missing_ok=True)
        metrics.close()


def run(args: argparse.Namespace) -> int:
    grpc_common.setup_logging(args.log_level, args.log_format)
    grpc_common.run(serve(args), switch_interval=args.switch_interval)
    return 0
