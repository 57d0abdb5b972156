"""`specwire bench --local`: in-process speculative decoding (TargetEngine verify + EagleProposer +
rejection_sample) over a prompt file; prints acceptance statistics as one JSON object.

acceptance_per_position[j] is the share of drafting rounds with at least j + 1 drafts in which draft j + 1
was accepted; mean_acceptance_length is the mean number of tokens a target step produced (accepted + 1)
over rounds that drafted at least one token.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from dataclasses import dataclass, field

import torch

from specwire.kernels.rejection_sampler import rejection_sample
from specwire.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="run target and drafter in this process")
    parser.add_argument("--prompts", required=True, help="JSONL: prompt | instruction | question | turns[0]")
    parser.add_argument("--k", type=int, default=4, help="drafts per round (default 4)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--draft-top-k",
        type=int,
        default=32,
        help="sampled drafts come from the top-K of the draft distribution (0 = all; default 32)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="use the first N prompts (0 = all)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests (default 8)")
    parser.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped head)")
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="target decode and drafter eager")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if not args.local:
        raise ValueError("this bench runs in-process only: pass --local")
    if not 1 <= args.k <= 16:
        raise ValueError(f"--k must be in [1, 16], got {args.k}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens).validate()
    from specwire.drafter.self_distill import read_prompts

    prompts = read_prompts(args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    if not prompts:
        raise ValueError(f"no prompts in {args.prompts}")
    engine, proposer = build_local(
        args.model, args.head, args.device, args.batch, args.k, cuda_graphs=not args.no_cuda_graphs
    )
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
        for i in range(len(ids))
    ]
    stats = SpecDecoder(engine, proposer, args.k, args.draft_top_k).run(ids, params).summary()
    stats |= {
        "prompts": len(ids),
        "k": args.k,
        "temperature": args.temperature,
        "batch": args.batch,
        "device": str(engine.device),
    }
    if args.json:
        print(json.dumps(stats))
    else:
        for key, value in stats.items():
            print(f"{key:>28}: {value}")
    return 0


def build_local(
    model: str | None, head_path: str | None, device: str | None, batch: int, k: int, cuda_graphs: bool = True
):
    """(TargetEngine, EagleProposer) sharing the target's embedding and lm_head."""
    from specwire.default_model import resolve_model_path
    from specwire.drafter.eagle_head import (
        DEFAULT_HEAD,
        head_aux_layers,
        load_eagle_head,
        shared_target_weights,
    )
    from specwire.drafter.proposer import EagleProposer
    from specwire.engine import TargetEngine
    from specwire.tokenizer import load_tokenizer
    from specwire.weights import load_checkpoint

    path = resolve_model_path(model)
    head_path = head_path or DEFAULT_HEAD
    config, state_dict = load_checkpoint(path)
    engine = TargetEngine(
        device=device,
        max_slots=batch,
        cuda_graphs=cuda_graphs,
        checkpoint=(config, state_dict),
        aux_layers=head_aux_layers(head_path, config),
        max_verify_tokens=k + 1,
    )
    del state_dict
    engine.tokenizer = load_tokenizer(path)
    head = load_eagle_head(
        head_path,
        engine.config,
        shared_target_weights(engine.model),
        dtype=engine.dtype,
        device=engine.device,
        max_positions=engine.max_context,
    )
    proposer = EagleProposer(
        head, max_requests=batch, max_context=engine.max_context, max_drafts=k, cuda_graphs=cuda_graphs
    )
    return engine, proposer


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    slot: int = -1
    output: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    drafted_rounds: int = 0
    emitted_in_drafted_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed_at, self.accepted_at = [0] * self.k, [0] * self.k

    def summary(self) -> dict:
        return {
            "mean_acceptance_length": round(self.emitted_in_drafted_rounds / max(self.drafted_rounds, 1), 4),
            "acceptance_per_position": [
                round(a / p, 4) if p else None
                for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
            ],
            "acceptance_rate": round(self.accepted_tokens / max(self.draft_tokens, 1), 4),
            "rounds": self.rounds,
            "drafts": self.drafted_rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
        }


class SpecDecoder:
    """Continuous-batching speculative decoding, in one process: admit -> (propose, verify, accept)*."""

    def __init__(self, engine, proposer, k: int, draft_top_k: int):
        self.engine, self.proposer, self.k, self.draft_top_k = engine, proposer, k, draft_top_k
        self.eos = set(engine.tokenizer.eos_token_ids) if engine.tokenizer else set()
        self.use_aux = proposer.head.config.arch == "eagle3"

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> SpecStats:
        stats = SpecStats(self.k)
        requests = [
            _Request(f"r{i}", p, sp, sp.seed if sp.seed is not None else secrets.randbits(62))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        for r in requests:
            r.params.validate(self.engine.config.vocab_size, self.engine.max_context - len(r.prompt))
        waiting, running = list(requests), []
        start = time.perf_counter()
        while waiting or running:
            admit = []
            while waiting and self.engine.num_free_slots:
                r = waiting.pop(0)
                r.slot = self.engine.allocate_slot()
                admit.append(r)
            if admit:
                self._prefill(admit)
                running += admit
            self._round(running, stats)
            for r in [r for r in running if r.done]:
                self.engine.free_slot(r.slot)
                self.proposer.free(r.rid)
                running.remove(r)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        stats.seconds = time.perf_counter() - start
        stats.outputs = [r.output for r in requests]
        stats.tokens = sum(len(o) for o in stats.outputs)
        return stats

    def _features(self, out) -> torch.Tensor:
        return out.aux_hidden if self.use_aux else out.hidden

    def _sample_tokens(self, logits, drafts, num_drafts, probs, batch: list[_Request]):
        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)

        return rejection_sample(
            logits,
            drafts.to(logits.device),
            num_drafts,
            probs,
            column([r.params.temperature for r in batch], torch.float32),
            column([r.params.top_k for r in batch], torch.int32),
            column([r.params.top_p for r in batch], torch.float32),
            column([r.seed for r in batch], torch.int64),
            column([r.length for r in batch], torch.int64),
        )

    def _prefill(self, batch: list[_Request]) -> None:
        out = self.engine.prefill([(r.slot, r.prompt) for r in batch])
        empty = torch.zeros(0, dtype=torch.int64)
        sampled = self._sample_tokens(
            out.logits, empty, torch.zeros(len(batch), dtype=torch.int32), None, batch
        )
        feats, offset = self._features(out), 0
        for r, token in zip(batch, sampled.tokens[:, 0].tolist(), strict=True):
            n = len(r.prompt)
            self._emit(r, [token])
            self.proposer.add(r.rid, r.prompt + [token], feats[offset : offset + n])
            offset += n

    def _round(self, batch: list[_Request], stats: SpecStats) -> None:
        live = [r for r in batch if not r.done]
        if not live:
            return
        # Never draft past max_tokens: the last round may need fewer drafts.
        ks = [
            min(self.k, r.params.max_tokens - len(r.output) - 1, self.engine.max_context - r.length - 1)
            for r in live
        ]
        ks = [max(k, 0) for k in ks]
        temps = [r.params.temperature for r in live]
        proposal = self.proposer.propose(
            [r.rid for r in live], ks, temps, [self.draft_top_k if t > 0 else 0 for t in temps]
        )
        ks = proposal.num_drafts.tolist()
        flat = proposal.token_ids.tolist()
        drafts = [flat[sum(ks[:b]) : sum(ks[: b + 1])] for b in range(len(live))]
        out = self.engine.verify(
            [r.slot for r in live],
            [[r.output[-1]] + d for r, d in zip(live, drafts, strict=True)],
            [r.length - 1 for r in live],
        )
        sampled = self._sample_tokens(
            out.logits, proposal.token_ids, proposal.num_drafts, proposal.probs, live
        )
        feats, offset = self._features(out), 0
        for r, k, row, n in zip(live, ks, sampled.tokens.tolist(), sampled.num_tokens.tolist(), strict=True):
            new = row[:n]
            stats.rounds += 1
            if k:
                stats.drafted_rounds += 1
                stats.emitted_in_drafted_rounds += n
                stats.draft_tokens += k
                stats.accepted_tokens += n - 1
                for j in range(k):
                    stats.proposed_at[j] += 1
                    stats.accepted_at[j] += j < n - 1
            self._emit(r, new)
            if not r.done:
                self.proposer.update(r.rid, new, feats[offset : offset + n])
            offset += k + 1

    def _emit(self, r: _Request, tokens: list[int]) -> None:
        for t in tokens:
            r.output.append(t)
            if (t in self.eos and not r.params.ignore_eos) or len(r.output) >= r.params.max_tokens:
                r.done = True
                return
