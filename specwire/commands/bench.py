"""`specwire bench --local`: speculative decoding in one process over a prompt file, through the verifier's
own Scheduler with the drafter co-located behind the in-process link; prints acceptance statistics as one
JSON object.

acceptance_per_position[j] is the share of verified drafts at position j + 1 that were accepted;
mean_acceptance_length is the mean number of tokens a verification produced (accepted + 1) over the
verifications that checked at least one draft; tokens_per_round counts every round of a request, so those
verified without drafts (a cache miss, a chain stopped by --min-confidence before its first draft) count
too: decode tokens / (decode tokens - accepted drafts), as each round yields its accepted drafts and one
token more (a request's first token comes from its prefill). With --cache-branches > 0 the drafts come from
speculation-cache tables (the cache's hit rate is reported); by default they are drafted for the settled
tokens each round, which measures the head alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

from specwire.metrics import JUST_IN_TIME_RESULTS, LOOKUP_RESULTS
from specwire.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="run target and drafter in this process")
    parser.add_argument("--prompts", required=True, help="JSONL: prompt | instruction | question | turns[0]")
    parser.add_argument("--k", type=int, default=4, help="drafts per round (default 4)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--draft-top-k",
        type=int,
        default=64,
        help="sampled drafts come from the top-K of the draft distribution (0 = all; default 64, as the "
        "verifier's)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="use the first N prompts (0 = all)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests (default 8)")
    parser.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped head)")
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="target decode and drafter eager")
    parser.add_argument(
        "--cache-branches",
        type=int,
        default=0,
        help="speculation-cache table entries per request (default 0: draft each round)",
    )
    parser.add_argument(
        "--queued-tables",
        type=int,
        default=0,
        help="drafts queued behind the sampler with tables ahead of this many branches a request, looked "
        "up from each sampler's output (greedy only; asked for in every round, to measure how often a table "
        "holds the outcome; default 0)",
    )
    parser.add_argument(
        "--table-wait-ms",
        type=float,
        default=None,
        help="how long a verification waits for its table (default: decided each round; a long wait "
        "measures how often the table holds the outcome, whatever the drafter's speed)",
    )
    parser.add_argument(
        "--just-in-time-wait-ms",
        type=float,
        default=None,
        help="how long a round waits for drafts made just in time for requests no table had drafts for "
        "(default: decided each round; 0 = never)",
    )
    from specwire.drafter.cli import add_min_confidence_argument

    add_min_confidence_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if not args.local:
        raise ValueError("this bench runs in-process only: pass --local")
    if not 1 <= args.k <= 16:
        raise ValueError(f"--k must be in [1, 16], got {args.k}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.cache_branches < 0 or args.queued_tables < 0:
        raise ValueError(f"--cache-branches and --queued-tables must be >= 0, got {args.cache_branches} and "
                         f"{args.queued_tables}")
    SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens).validate()
    from specwire.drafter.self_distill import read_prompts

    prompts = read_prompts(args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    if not prompts:
        raise ValueError(f"no prompts in {args.prompts}")
    engine, tokenizer = build_engine(
        args.model, args.head, args.device, args.batch, args.k, cuda_graphs=not args.no_cuda_graphs
    )
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)] * len(ids)
    result = asyncio.run(
        speculate(
            engine,
            tokenizer,
            args.head,
            ids,
            params,
            k=args.k,
            cache_branches=args.cache_branches,
            queued_tables=args.queued_tables,
            min_confidence=args.min_confidence,
            table_wait=None if args.table_wait_ms is None else args.table_wait_ms / 1e3,
            just_in_time_wait=None if args.just_in_time_wait_ms is None else args.just_in_time_wait_ms / 1e3,
            draft_top_k=args.draft_top_k,
            cuda_graphs=not args.no_cuda_graphs,
        )
    )
    stats = result.summary() | {
        "prompts": len(ids),
        "k": args.k,
        "temperature": args.temperature,
        "batch": args.batch,
        "cache_branches": args.cache_branches,
        "queued_tables": args.queued_tables,
        "min_confidence": args.min_confidence,
        "device": str(engine.device),
    }
    if args.json:
        print(json.dumps(stats))
    else:
        for key, value in stats.items():
            print(f"{key:>28}: {value}")
    return 0


def build_engine(
    model: str | None, head_path: str | None, device: str | None, batch: int, k: int, cuda_graphs: bool = True
):
    """(TargetEngine tapping the layers the head reads, its tokenizer)."""
    from specwire.default_model import resolve_model_path
    from specwire.drafter.eagle_head import DEFAULT_HEAD, head_aux_layers
    from specwire.engine import TargetEngine
    from specwire.tokenizer import load_tokenizer
    from specwire.weights import load_checkpoint

    path = resolve_model_path(model)
    config, state_dict = load_checkpoint(path)
    engine = TargetEngine(
        device=device,
        max_slots=batch,
        cuda_graphs=cuda_graphs,
        checkpoint=(config, state_dict),
        aux_layers=head_aux_layers(head_path or DEFAULT_HEAD, config),
        max_verify_tokens=k + 1,
    )
    engine.tokenizer = load_tokenizer(path)
    return engine, engine.tokenizer


@dataclass
class LocalRun:
    """Outputs per prompt and the verifier's own counters after a run."""

    outputs: list[list[int]]
    seconds: float
    metrics: object  # VerifierMetrics

    def _value(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(f"specwire_{name}_total", labels or None) or 0.0

    def summary(self) -> dict:
        drafts = self._value("spec_decode_num_drafts")
        draft_tokens = self._value("spec_decode_num_draft_tokens")
        accepted = self._value("spec_decode_num_accepted_tokens")
        per_position, j = [], 0
        while drafted := self._value("spec_decode_num_draft_tokens_per_pos", position=str(j)):
            per_position.append(
                round(self._value("spec_decode_num_accepted_tokens_per_pos", position=str(j)) / drafted, 4)
            )
            j += 1
        lookups = {r: self._value("spec_cache_lookups", result=r) for r in LOOKUP_RESULTS}
        looked_up = sum(lookups.values()) - lookups["unasked"]  # unasked: no table to look in
        tokens = sum(len(o) for o in self.outputs)
        decode = tokens - sum(1 for o in self.outputs if o)  # a request's first token comes from its prefill
        return {
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else 1.0,
            "acceptance_per_position": per_position,
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
            "drafts": int(drafts),
            "draft_tokens": int(draft_tokens),
            "accepted_tokens": int(accepted),
            "cache_hit_rate": round(lookups["hit"] / looked_up, 4) if looked_up else None,
            "cache_lookups": {r: int(n) for r, n in lookups.items()},
            "queued_tables_served": int(self._value("queued_tables_served")),
            "just_in_time": {
                r: int(self._value("spec_cache_just_in_time", result=r)) for r in JUST_IN_TIME_RESULTS
            },
            "tokens": tokens,
            "tokens_per_round": round(decode / (decode - accepted), 4) if decode > accepted else None,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tokens / self.seconds, 2) if self.seconds else 0.0,
        }


async def speculate(
    engine,
    tokenizer,
    head: str | None,
    prompts: list[list[int]],
    params: list[SamplingParams],
    k: int,
    cache_branches: int = 0,
    queued_tables: int = 0,
    min_confidence: float = 0.0,
    table_wait: float | None = None,
    just_in_time_wait: float | None = None,
    draft_top_k: int = 64,
    cuda_graphs: bool = True,
) -> LocalRun:
    """Runs every prompt through a Scheduler whose drafter is co-located; all are queued at once and the
    engine's slots bound the batch."""
    from specwire.colocated import colocated_link
    from specwire.metrics import VerifierMetrics
    from specwire.verifier.scheduler import Scheduler, SchedulerConfig

    metrics = VerifierMetrics()
    link = colocated_link(
        engine,
        tokenizer,
        metrics,
        head=head,
        device=None,
        k=k,
        max_branches=max(cache_branches, queued_tables),
        cuda_graphs=cuda_graphs,
        min_confidence=min_confidence,
        step_timeout=60.0,
    )
    config = SchedulerConfig(
        num_speculative_tokens=k,
        max_waiting=len(prompts),
        draft_top_k=draft_top_k,
        cache_branches=cache_branches,
        table_wait=table_wait,
        just_in_time_wait=just_in_time_wait,
        queue_drafts=True if queued_tables else None,
        queued_tables=queued_tables,
        queued_tables_worth=0.0,  # a measurement: every steady round asks, whatever the hit rate
        queued_tables_epoch=0,  # (and whatever serial rounds would measure)
    )
    scheduler = Scheduler(engine, tokenizer, metrics, config, link)
    scheduler.start()
    started = time.perf_counter()
    try:
        requests = [
            scheduler.submit(p, q, request_id=str(i))
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))
        ]
        outputs = []
        for r in requests:
            while (out := await r.outputs.get()).finish_reason is None:
                pass
            if out.finish_reason == "error":
                raise RuntimeError(f"request {r.id} failed: {out.error}")
            outputs.append(r.tokens[len(r.prompt) :])
    finally:
        seconds = time.perf_counter() - started
        await scheduler.close()
    return LocalRun(outputs, seconds, metrics)
