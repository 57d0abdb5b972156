"""Draft time of EagleProposer.propose for k drafts, with and without CUDA graphs, at several batch sizes.

A random-weight EAGLE head of the requested target shape (default SmolLM2-135M: hidden 576, 9/3 heads,
vocab 49152) drafts from ~--context cached pairs per request; each timed round first feeds every request
1 + k/2 new pairs (an average acceptance), as in serving. Prints a table and writes JSON to --out.

    python bench/bench_drafter.py --out bench/results/drafter_h100.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from shapes import SHAPES  # bench/shapes.py: scripts run as `python bench/<name>.py`
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig
from specwire.drafter.proposer import EagleProposer

from specwire.config import ModelConfig


def random_head(config: ModelConfig, arch: str, device: str) -> EagleHead:
    head_config = EagleHeadConfig.for_target(config, arch, draft_vocab_size=32000)
    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=torch.bfloat16, device=device) * 0.02

    shared = {"model.embed_tokens.weight": rand(config.vocab_size, config.hidden_size)}
    if not config.tie_word_embeddings:
        shared["lm_head.weight"] = rand(config.vocab_size, config.hidden_size)
    head = EagleHead(head_config, shared, torch.bfloat16, device, 4096)
    head.init_weights()
    return head.requires_grad_(False)


def time_propose(
    head: EagleHead,
    batch: int,
    k: int,
    context: int,
    graphs: bool,
    rounds: int,
    temperature: float,
    top_k: int,
) -> float:
    """Median milliseconds of one propose() for `batch` requests (after warm-up rounds)."""
    proposer = EagleProposer(
        head,
        max_requests=batch,
        max_context=context + 8 * (rounds + 5) * k,
        max_drafts=k,
        max_top_k=max(top_k, 1),
        cuda_graphs=graphs,
    )
    F, dev = head.config.feature_dim, head.device
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        proposer.add(rid, [1] * (context + 1), torch.randn(context, F, device=dev, dtype=head.dtype))
    args = (ids, [k] * batch, [temperature] * batch, [top_k] * batch)
    proposer.propose(*args)
    times = []
    new = 1 + k // 2
    for i in range(rounds + 3):
        for rid in ids:
            proposer.update(rid, [2] * new, torch.randn(new, F, device=dev, dtype=head.dtype))
        torch.cuda.synchronize()
        start = time.perf_counter()
        proposer.propose(*args)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--arch", choices=["eagle1", "eagle3"], default="eagle1")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=512, help="cached pairs per request before timing")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy drafts")
    p.add_argument("--top-k", type=int, default=0, help="draft top-K truncation when sampling")
    p.add_argument("--out", default="bench/results/drafter.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_drafter needs CUDA")
    head = random_head(SHAPES[args.shape], args.arch, "cuda")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = {"batch": batch}
        for graphs in (True, False):
            key = "graph_ms" if graphs else "eager_ms"
            row[key] = round(
                time_propose(
                    head, batch, args.k, args.context, graphs, args.rounds, args.temperature, args.top_k
                ),
                3,
            )
        row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
        rows.append(row)
        print(
            f"batch {batch:>3}: graph {row['graph_ms']:8.3f} ms   eager {row['eager_ms']:8.3f} ms   "
            f"x{row['speedup']}",
            flush=True,
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "arch": args.arch,
        "k": args.k,
        "context": args.context,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "metric": "median ms per propose() incl. host prep and output packing",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'batch':>6} {'graph ms':>10} {'eager ms':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['graph_ms']:>10.3f} {r['eager_ms']:>10.3f} {r['speedup']:>8.2f}")


if __name__ == "__main__":
    main()
