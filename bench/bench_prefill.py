"""A verifier's prefill step in pieces, target-only against speculating (the target taps the drafter's aux
layers and hands every prompt token's features to a co-located drafter's FeatureStore): why a speculative
verifier's prefill steps take longer than a target-only one's (8B shape, 2 x H100: 70.8-74.3 ms against
53.3 ms a step in bench/results/session23_h100x2/).

    python bench/bench_prefill.py --model synthetic:llama-3.1-8b --store-device cuda:1 --out prefill.json

Each configuration builds its engine as the verifier does (load_engine's flags), prefills `--prompts`
prompts of the committed held-out chat set (chat template, the model's tokenizer, the bench's 800-byte cut)
into fresh slots, and times on the host, after a device sync, the median of --repeats steps of: the forward
alone; the forward and the sampler's token read-back (a target-only prefill step); and that plus the feature
table and the store write (a speculating one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from services_client import read_prompts  # bench/ modules: scripts run as `python bench/<name>.py`
from specwire.drafter.train_eagle import code_commit
from specwire.kernels.rejection_sampler import rejection_sample
from specwire.verifier.cli import parse_aux_layers
from specwire.verifier.feature_store import FeatureStore

from specwire.engine import PREFILL_ROW, TargetEngine, prefill_rows
from specwire.model_source import load_model

PROMPTS = Path(__file__).parent / "data" / "heldout_chat_sharegpt.jsonl"


def greedy_tokens(logits: torch.Tensor) -> list[list[int]]:
    """The prefill's first tokens as the verifier samples them (greedy, no drafts), read back."""
    B = logits.shape[0]
    zeros = np.zeros(B, dtype=np.int64)
    out = rejection_sample(logits, np.zeros(0, dtype=np.int64), zeros.astype(np.int32), None,
                           zeros.astype(np.float32), zeros.astype(np.int32), np.ones(B, dtype=np.float32),
                           zeros, zeros, defer_check=True)
    return out.token_lists()


def timed(step, repeats: int, device: torch.device) -> float:
    """Median ms of `step()` over `repeats` calls, each after a device sync."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times[1:])


def measure(args: argparse.Namespace, prompts: list[list[int]], speculating: bool) -> dict:
    device = torch.device(args.device)
    config, weights, _, _ = load_model(args.model, device, torch.bfloat16)
    aux = parse_aux_layers("eagle3", config.num_layers) if speculating else ()
    engine = TargetEngine(device=device, dtype=torch.bfloat16, max_slots=args.max_slots,
                          max_context=args.max_context, aux_layers=aux, max_verify_tokens=args.k + 1,
                          checkpoint=(config, weights))
    del weights
    slots = [engine.allocate_slot() for _ in prompts]
    requests = list(zip(slots, prompts, strict=True))
    row = {"speculating": speculating, "aux_layers": list(aux),
           "prefill_graph": engine.prefill_graphs is not None,
           "forwards": len(prefill_rows(requests, PREFILL_ROW).chunks(engine.prefill_rows_per_forward)),
           "forward_ms": timed(lambda: engine.prefill(requests), args.repeats, device),
           "step_ms": timed(lambda: greedy_tokens(engine.prefill(requests).logits), args.repeats, device)}
    if speculating:
        H = config.hidden_size
        store = FeatureStore(args.max_slots, args.max_context, slice(H, 4 * H), 3 * H, torch.bfloat16,
                             torch.device(args.store_device), source=device)

        def step_with_store() -> None:
            out = engine.prefill(requests)
            greedy_tokens(out.logits)
            store.write(out.hidden, out.aux_hidden, [s for s, p in requests for _ in p],
                        [i for _, p in requests for i in range(len(p))])
            store.ready()

        row["step_with_store_ms"] = timed(step_with_store, args.repeats, device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:llama-3.1-8b")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--store-device", default="cuda:0", help="the co-located drafter's GPU")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in one prefill step")
    parser.add_argument("--max-slots", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    _, _, tokenizer, _ = load_model(args.model, torch.device("cpu"), torch.bfloat16, names=())
    texts = read_prompts(PROMPTS, max_bytes=800)[:args.prompts]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
               for text in texts]
    rows = []
    for speculating in (False, True):
        rows.append(measure(args, prompts, speculating))
        if args.device.startswith("cuda"):  # the last engine is gone: its memory goes back before the next
            torch.cuda.empty_cache()
    result = {
        "bench": "bench_prefill.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": code_commit(),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "args": {k: str(v) for k, v in vars(args).items()},
        "prompt_tokens": [len(p) for p in prompts], "results": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
