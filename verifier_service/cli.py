"""`specwire verifier`: serve the client-facing Generation API, verifying a drafter's proposals."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from specwire.drafter.cli import add_min_confidence_argument
from specwire.verifier.drafting_mode import DEFAULT_EPOCH_ROUNDS, check_modes

from specwire import grpc_common
from specwire.config import default_aux_layers

log = logging.getLogger("specwire.verifier")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = grpc_common.env_default
    grpc_common.add_server_arguments(parser, default_listen="0.0.0.0:50051")
    parser.add_argument("--drafter", default=env("SPECWIRE_DRAFTER", None),
                        help="drafter HOST:PORT (env SPECWIRE_DRAFTER); without one (or --colocated), "
                             "target-only decoding")
    parser.add_argument("--drafter-socket", default=env("SPECWIRE_DRAFTER_SOCKET", None), metavar="PATH",
                        help="with --drafter on this host: the drafter's --step-socket; the per-round Draft "
                             "stream goes over it instead of gRPC (env SPECWIRE_DRAFTER_SOCKET)")
    parser.add_argument("--no-shared-features", action="store_true",
                        default=env("SPECWIRE_NO_SHARED_FEATURES", False),
                        help="send a drafter on this host the features as bytes in each step; by default a "
                             "verifier on a GPU shares its feature table with such a drafter by CUDA IPC "
                             "and the steps name rows of it (env SPECWIRE_NO_SHARED_FEATURES)")
    parser.add_argument("--colocated", action="store_true",
                        help="run the drafter inside this process (same scheduler and link, no gRPC hop)")
    parser.add_argument("--head", default=env("SPECWIRE_HEAD", None),
                        help="with --colocated: EAGLE head directory (default: the shipped head)")
    parser.add_argument("--drafter-device", default=None,
                        help="with --colocated: the drafter's device (default: the target's)")
    add_min_confidence_argument(parser)  # with --colocated: the in-process drafter's
    grpc_common.add_channel_arguments(parser, prefix="drafter-")
    grpc_common.add_model_arguments(parser, dtype_of="weights and KV cache")
    parser.add_argument("--k", type=int, default=env("SPECWIRE_K", 4),
                        help="draft tokens per request per round (default 4; 0 = no speculation)")
    parser.add_argument("--max-slots", type=int, default=env("SPECWIRE_MAX_SLOTS", 16),
                        help="requests decoded at once (default 16)")
    parser.add_argument("--max-context", type=int, default=env("SPECWIRE_MAX_CONTEXT", None),
                        help="tokens per request, prompt + output (default: min(2048, the model's))")
    parser.add_argument("--max-waiting", type=int, default=env("SPECWIRE_MAX_WAITING", 256),
                        help="requests queued for a slot before new ones are refused (default 256)")
    parser.add_argument("--default-max-tokens", type=int, default=env("SPECWIRE_DEFAULT_MAX_TOKENS", 128),
                        help="max_tokens of requests that leave it unset (default 128)")
    parser.add_argument("--draft-timeout", type=float, default=env("SPECWIRE_DRAFT_TIMEOUT", 1.0),
                        help="seconds a step waits for its drafts before verifying without them (default 1)")
    parser.add_argument("--draft-top-k", type=int, default=env("SPECWIRE_DRAFT_TOP_K", 64),
                        help="sampled requests draft from the head's top-K, shipped sparse (default 64, the "
                             "drafter's --max-top-k)")
    parser.add_argument("--cache-branches", type=int, default=env("SPECWIRE_CACHE_BRANCHES", None),
                        help="speculation cache: table entries per request the drafter drafts while a "
                             "verification runs (0 = wait for drafts each round; default 8, or 0 with "
                             "--colocated, whose drafts queued behind the sampler measured faster than "
                             "tables: bench/results/session19_h200x2/; across two processes 0 measured "
                             "faster for greedy requests, slower for sampled ones: bench/results/session29/)")
    parser.add_argument("--table-wait-ms", type=float, default=env("SPECWIRE_TABLE_WAIT_MS", None),
                        help="how long a finished verification waits for a table still on its way "
                             "(default: decided each round: waited for when it is due within what a hit "
                             "is worth, else not at all)")
    parser.add_argument("--just-in-time-wait-ms", type=float,
                        default=env("SPECWIRE_JUST_IN_TIME_WAIT_MS", None),
                        help="how long a round waits for drafts made just in time for requests no table had "
                             "drafts for (a miss, a late table) (default: decided each round: waited for "
                             "when the tokens they add are worth the wait; 0 = never)")
    parser.add_argument("--drafting-epoch", type=int, default=env("SPECWIRE_DRAFTING_EPOCH", None),
                        metavar="ROUNDS",
                        help="with the speculation cache: try epochs of this many rounds of serial drafting "
                             "and of rounds without drafts beside the tables, and keep to whichever settles "
                             "the most tokens per request-second (serial wins where tables come late, none "
                             "where no drafting pays; 0 = tables always; default 16 for a remote drafter: "
                             "the best mode or within 0.04x of it at every point of two runs, SmolLM2 on two "
                             "H200s, bench/results/session31/)")
    parser.add_argument("--drafting-modes", default=env("SPECWIRE_DRAFTING_MODES", None), metavar="MODES",
                        help="with --drafting-epoch: the modes it chooses from, comma-separated, the first "
                             "run first (tables, serial, none; default all three, but where serial drafts "
                             "are queued behind the sampler (--queue-drafts) serial,none: queued serial "
                             "rounds beat the tables there, bench/results/session35/)")
    parser.add_argument("--queue-drafts", choices=("auto", "on", "off"),
                        default=env("SPECWIRE_QUEUE_DRAFTS", "auto"),
                        help="with serial drafting (--cache-branches 0, or the serial epochs of "
                             "--drafting-epoch but their last rounds): queue each round's next drafts on the "
                             "drafter's device right behind its sampler, with no return to the host between: "
                             "--colocated without a DraftStep; a drafter in another process on this host "
                             "that maps the features by a step sent while the target's forward runs, its GPU "
                             "waiting for a number the verifier's GPU writes into shared memory after the "
                             "sampler (default auto: on for a CUDA drafter co-located or on the step socket "
                             "of --drafter-socket; over gRPC only with on)")
    parser.add_argument("--queued-tables", type=int, default=env("SPECWIRE_QUEUED_TABLES", 0),
                        metavar="BRANCHES",
                        help="with drafts queued behind the sampler (greedy rows, a drafter with branch "
                             "slots): ask the drafter for tables ahead of this many branches a request, "
                             "drafted while each verification runs and looked up on its GPU from the "
                             "sampler's output; a round whose every request hit gets the tables' drafts at "
                             "once, before the serial drafting (default 0: serial drafts only; "
                             "--forced-hit-rate forces the drafter's lookups instead)")
    parser.add_argument("--queued-tables-epoch", type=int,
                        default=env("SPECWIRE_QUEUED_TABLES_EPOCH", DEFAULT_EPOCH_ROUNDS), metavar="ROUNDS",
                        help="with --queued-tables: rounds that may ask for tables run in epochs of this "
                             "many rounds with and without them, and the faster measured asks (a table costs "
                             "the drafter time each round that a short verification may not hide; default "
                             f"{DEFAULT_EPOCH_ROUNDS}; 0: ask in every round that may)")
    parser.add_argument("--drafts-on-device", choices=("on", "off"),
                        default=env("SPECWIRE_DRAFTS_ON_DEVICE", "on"),
                        help="with drafts queued in a drafter process on this host's GPUs: the drafter's GPU "
                             "also writes them into this verifier's GPU memory, and the next verification of "
                             "a greedy batch of the same requests reads them there instead of waiting for "
                             "the answer (default on; off: always wait for the answer)")
    parser.add_argument("--launch-ahead", choices=("on", "off"), default=env("SPECWIRE_LAUNCH_AHEAD", "on"),
                        help="with drafts read on this GPU: queue each round's forward right behind the last "
                             "round's launch, fed from that round's sampler on the GPU, before its tokens "
                             "reach the host (default on; off: launch it once they are settled)")
    parser.add_argument("--stream-interval", type=int, default=env("SPECWIRE_STREAM_INTERVAL", 1),
                        metavar="TOKENS",
                        help="tokens a stream's chunk gathers before it is sent; a request's first token and "
                             "its last ones go at once (default 1; more: fewer writes a round, coarser "
                             "inter-token latency)")
    parser.add_argument("--admit-wait-ms", type=float, default=env("SPECWIRE_ADMIT_WAIT_MS", 0.0),
                        help="while requests decode, how long a new request may wait for more to share its "
                             "prefill step (default 0: prefilled at once; never once the waiting fill the "
                             "free slots)")
    parser.add_argument("--carry-rows", type=int, default=env("SPECWIRE_CARRY_ROWS", 64),
                        help="while requests decode, a new request's prompt rides the next verification's "
                             "forward in rows of --carry-width tokens, up to this many rows beyond the batch "
                             "(CUDA graphs are captured for them) instead of a prefill step of its own, "
                             "which pauses every stream (default 64; 0: every admission gets a prefill step)")
    parser.add_argument("--carry-width", type=int, default=env("SPECWIRE_CARRY_WIDTH", 5),
                        help="tokens a carried prompt's row feeds (default 5, the verification width of the "
                             "default --k; at least 2)")
    parser.add_argument("--aux-layers", default=env("SPECWIRE_AUX_LAYERS", "eagle3"),
                        help="target layers whose input EAGLE-3 heads read: comma-separated, 'eagle3' "
                             "(2, L/2, L-3) or 'none' (default eagle3)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the decode step eagerly")
    parser.add_argument("--forced-acceptance-length", type=float,
                        default=env("SPECWIRE_FORCED_ACCEPTANCE_LENGTH", None), metavar="L",
                        help="benchmarks only: accept drafts at random so that a round yields L tokens on "
                             "average, in [1, k + 1], whatever they are (the output is not the target's)")
    parser.add_argument("--forced-hit-rate", type=float, default=env("SPECWIRE_FORCED_HIT_RATE", None),
                        metavar="R",
                        help="benchmarks only: make this share of speculation-cache lookups hit by taking a "
                             "table entry's bonus token (the output is not the target's)")
    parser.add_argument("--frontend", choices=("inline", "process"),
                        default=env("SPECWIRE_FRONTEND", "process"),
                        help="where the client streams are served: by a front-end process this one starts "
                             "(`specwire verifier-frontend`), which relays them over a Unix socket, so that "
                             "their writes leave the loop that launches the verifications (default process: "
                             "target-only tok/s +40-60%% at batch 16-64 on two H200s, "
                             "bench/results/session36/), or on this process's event loop beside the "
                             "scheduler (inline) (env SPECWIRE_FRONTEND)")
    parser.add_argument("--metrics-port", type=int, default=env("SPECWIRE_METRICS_PORT", None),
                        help="serve Prometheus /metrics on this port (env SPECWIRE_METRICS_PORT)")
    grpc_common.add_logging_arguments(parser)


def parse_aux_layers(text: str, num_layers: int) -> tuple[int, ...]:
    if text == "none":
        return ()
    if text == "eagle3":
        return default_aux_layers(num_layers)
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers must be 'eagle3', 'none' or comma-separated integers, got {text!r}"
                         ) from None
    if bad := [x for x in layers if not 0 <= x < num_layers]:
        raise ValueError(f"--aux-layers: layer {bad[0]} out of range for a {num_layers}-layer model")
    return layers


def drafter_channel(args: argparse.Namespace, server: grpc_common.ServerOptions
                    ) -> grpc_common.ChannelOptions:
    """The channel to the drafter: its --drafter-tls-* flags, and the server's message bound (a step carries
    new prompts' features, up to 3/4 of it: scheduler._send_step)."""
    options = grpc_common.ChannelOptions.from_args(args, prefix="drafter-")
    return dataclasses.replace(options, max_message_bytes=server.max_message_bytes)


def load_engine(args: argparse.Namespace):
    """(engine, tokenizer, model name) from the flags; the engine taps the aux layers only with a drafter."""
    from specwire.engine import TargetEngine, device_and_dtype  # torch loads here, once the flags are valid
    from specwire.model_source import load_model

    device, dtype = device_and_dtype(args.device, args.dtype)
    config, state_dict, tokenizer, name = load_model(args.model, device, dtype)
    speculating = (args.drafter or args.colocated) and args.k > 0
    aux = parse_aux_layers(args.aux_layers, config.num_layers) if speculating else ()
    engine = TargetEngine(device=device, dtype=dtype, max_slots=args.max_slots,
                          max_context=args.max_context, cuda_graphs=not args.no_cuda_graphs, aux_layers=aux,
                          max_verify_tokens=args.k + 1, checkpoint=(config, state_dict),
                          carry_rows=args.carry_rows, carry_width=args.carry_width)
    return engine, tokenizer, name


def check_flags(args: argparse.Namespace) -> None:
    """Rejects flags out of range or in conflict, and fills in the defaults that follow from others (the
    speculation cache for a remote drafter, its drafting mode)."""
    if args.k < 0:
        raise ValueError(f"--k must be >= 0, got {args.k}")
    if args.colocated and args.drafter:
        raise ValueError("--colocated runs the drafter in this process: leave out --drafter")
    if args.drafter_socket and not args.drafter:
        raise ValueError("--drafter-socket needs --drafter HOST:PORT (the handshake goes over gRPC)")
    if args.queue_drafts not in ("auto", "on", "off"):  # argparse leaves a default (SPECWIRE_*) unchecked
        raise ValueError(f"--queue-drafts must be auto, on or off, got {args.queue_drafts!r}")
    for flag in ("drafts_on_device", "launch_ahead"):
        if getattr(args, flag) not in ("on", "off"):
            raise ValueError(f"--{flag.replace('_', '-')} must be on or off, got {getattr(args, flag)!r}")
    if args.cache_branches is None:
        args.cache_branches = 0 if args.colocated else 8
    if args.cache_branches < 0:
        raise ValueError(f"--cache-branches must be >= 0, got {args.cache_branches}")
    if args.drafting_epoch is None:  # measured for a remote drafter with the cache (bench/results/session31/)
        args.drafting_epoch = DEFAULT_EPOCH_ROUNDS if args.cache_branches > 0 and not args.colocated else 0
    if args.drafting_epoch < 0:
        raise ValueError(f"--drafting-epoch must be >= 0, got {args.drafting_epoch}")
    if args.drafting_modes is not None:
        args.drafting_modes = tuple(m.strip() for m in args.drafting_modes.split(","))
        check_modes(args.drafting_modes, "--drafting-modes")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if not 0 <= args.admit_wait_ms <= 10_000:
        raise ValueError(f"--admit-wait-ms must be in [0, 10000], got {args.admit_wait_ms}")
    if not 0 <= args.carry_rows <= 1024 or not 2 <= args.carry_width <= 64:
        raise ValueError(f"--carry-rows must be in [0, 1024] and --carry-width in [2, 64], got "
                         f"{args.carry_rows} and {args.carry_width}")
    if args.frontend not in ("inline", "process"):  # argparse leaves a default (SPECWIRE_*) unchecked
        raise ValueError(f"--frontend must be inline or process, got {args.frontend!r}")
    if args.queued_tables < 0:
        raise ValueError(f"--queued-tables must be >= 0, got {args.queued_tables}")
    if args.queued_tables_epoch < 0:
        raise ValueError(f"--queued-tables-epoch must be >= 0, got {args.queued_tables_epoch}")
    if args.forced_hit_rate is not None and not 0 <= args.forced_hit_rate <= 1:
        raise ValueError(f"--forced-hit-rate must be in [0, 1], got {args.forced_hit_rate}")


async def serve(args: argparse.Namespace) -> None:
    from specwire.kernels.rejection_sampler import warm_up
    from specwire.verifier.drafter_link import LocalDrafterLink
    from specwire.verifier.scheduler import SchedulerConfig
    from specwire.verifier.server import VerifierServer, VerifierSettings

    from specwire.engine import TargetEngine
    from specwire.forced_acceptance import forced_rates, rates_tensor
    from specwire.metrics import VerifierMetrics
    from specwire.tokenizer import Tokenizer

    check_flags(args)
    forced = None
    if args.forced_acceptance_length is not None:
        forced = forced_rates(float(args.forced_acceptance_length), args.k)  # checks the range
    metrics = VerifierMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    table_wait = None if args.table_wait_ms is None else args.table_wait_ms / 1e3
    jit_wait = None if args.just_in_time_wait_ms is None else args.just_in_time_wait_ms / 1e3
    options = grpc_common.ServerOptions.from_args(args)
    settings = VerifierSettings(
        drafter=args.drafter if args.k > 0 else None,
        drafter_socket=args.drafter_socket,
        shared_features=not args.no_shared_features,
        drafts_on_device=args.drafts_on_device == "on",
        drafter_channel=drafter_channel(args, options),
        step_timeout=args.draft_timeout,
        scheduler=SchedulerConfig(num_speculative_tokens=args.k, max_waiting=args.max_waiting,
                                  default_max_tokens=args.default_max_tokens, draft_top_k=args.draft_top_k,
                                  cache_branches=args.cache_branches,
                                  table_wait=table_wait, just_in_time_wait=jit_wait,
                                  drafting_epoch=args.drafting_epoch, drafting_modes=args.drafting_modes,
                                  forced_acceptance=forced,
                                  forced_hit_rate=args.forced_hit_rate,
                                  stream_interval=args.stream_interval,
                                  admit_wait=args.admit_wait_ms / 1e3,
                                  queue_drafts={"on": True, "off": False}.get(args.queue_drafts),
                                  queued_tables=args.queued_tables,
                                  queued_tables_epoch=args.queued_tables_epoch,
                                  launch_ahead=args.launch_ahead == "on"),
    )

    async def load() -> tuple[TargetEngine, Tokenizer, LocalDrafterLink | None, str]:
        engine, tokenizer, name = await asyncio.to_thread(load_engine, args)
        # Triton compiles the sampler's variants now, with the forced rates the scheduler will pass, rather
        # than while a request waits.
        max_drafts = args.k if settings.drafter or args.colocated else 0
        calls = await asyncio.to_thread(warm_up, engine.device, engine.config.vocab_size, max_drafts,
                                        rates_tensor(forced), args.draft_top_k)
        log.info("sampler warmed up", extra={"variants": calls})
        link = None
        if args.colocated and args.k > 0:
            from specwire.colocated import colocated_link
            from specwire.synthetic import head_or_random

            link = await asyncio.to_thread(
                colocated_link, engine, tokenizer, metrics, head=head_or_random(args.model, args.head),
                device=args.drafter_device,
                k=args.k, max_branches=max(args.cache_branches, args.queued_tables),
                cuda_graphs=not args.no_cuda_graphs,
                min_confidence=args.min_confidence, step_timeout=args.draft_timeout)
        return engine, tokenizer, link, name

    if args.frontend == "process":
        from specwire.verifier import frontend
        from specwire.verifier.core_socket import serve_core

        command = frontend.command(options, args.log_level, args.log_format)
        if await serve_core(options, settings, metrics, load, command):
            raise SystemExit(1)
        return
    server = VerifierServer(options, settings, metrics)

    async def ready() -> None:
        engine, tokenizer, link, name = await load()
        server.service.model_name = name
        await server.start(engine, tokenizer, link)
        extra = {"model": name, "device": str(engine.device), "drafter": settings.drafter, "k": args.k}
        log.info("verifier ready", extra=extra)

    try:
        await server.grpc.serve_forever(on_ready=ready)
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    grpc_common.setup_logging(args.log_level, args.log_format)
    grpc_common.run(serve(args), switch_interval=args.switch_interval)
    return 0
