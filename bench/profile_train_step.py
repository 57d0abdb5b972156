"""Where a `specwire train-eagle` step's time goes (GPU), without the model or data staged.

The trainer's own step (drafter_service.eagle_trainer.Trainer) for an EAGLE-3 head on a synthetic target (a
real model's shapes, random weights) over random token ids with the training data's lengths: the step time,
the target's feature recording alone, then a torch.profiler table of a few steps' kernels.

    python bench/profile_train_step.py --model synthetic:smollm2-135m --out bench/results/train_step_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time

import torch
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig, shared_target_weights
from specwire.drafter.eagle_trainer import Trainer
from specwire.drafter.self_distill import Conversation, record_features
from specwire.drafter.train_eagle import DEFAULT_DRAFT_VOCAB, add_arguments, code_commit

from specwire.config import default_aux_layers
from specwire.engine import TargetEngine
from specwire.synthetic import synthetic_config, synthetic_shape


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--conversations", type=int, default=1500)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 5 warm-up steps)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--batch-tokens", default="8192", help="comma-separated --batch-tokens to compare")
    p.add_argument("--out")
    return p.parse_args()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main() -> None:
    a = parse_args()
    aux = default_aux_layers(synthetic_config(synthetic_shape(a.model)).num_layers)
    engine = TargetEngine(
        a.model, device=a.device, max_slots=256, max_context=1024, max_prefill_tokens=32768, aux_layers=aux
    )
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    data = []
    for _ in range(a.conversations):
        n = rng.randint(a.min_len, a.max_len)
        data.append(Conversation([rng.randrange(vocab) for _ in range(n)], n // 3, "random"))
    runs = [measure(engine, data, int(b), a) for b in a.batch_tokens.split(",")]
    result = {
        "command": "python bench/profile_train_step.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": code_commit(),
        "model": a.model,
        "runs": runs,
    }
    for run in runs:
        print(run.pop("kernels") if not a.out else run["kernels"])
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k != "kernels"} for r in runs], indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def measure(engine: TargetEngine, data: list[Conversation], batch_tokens: int, a: argparse.Namespace) -> dict:
    """One trainer (fresh head and optimizer) at --batch-tokens batch_tokens: step and feature-pass times."""
    train_args = argparse.ArgumentParser()
    add_arguments(train_args)
    targs = train_args.parse_args(["--device", a.device, "--batch-tokens", str(batch_tokens)])
    config = EagleHeadConfig.for_target(engine.config, "eagle3", targs.draft_vocab or DEFAULT_DRAFT_VOCAB)
    head = EagleHead(config, shared_target_weights(engine.model), torch.float32, engine.device, 1024)
    head.init_weights(0)
    vocab = engine.config.vocab_size
    head.draft_to_target.copy_(torch.randperm(vocab)[: config.draft_vocab_size].sort().values)
    head.requires_grad_(False)
    for p in head.trainable_parameters().values():
        p.requires_grad_(True)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(head, engine, targs, cuda=cuda)
    batches = [[data[i] for i in b] for b in trainer._batches(data, epoch=0)]
    order = iter(batches * 100)
    for _ in range(5):
        trainer._train_step(next(order))
    timed = [next(order) for _ in range(a.steps)]
    step_s = synced(lambda: [trainer._train_step(b) for b in timed]) / a.steps
    features_s = synced(lambda: [record_features(engine, b) for b in timed]) / a.steps
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(a.profile_steps):
            trainer._train_step(next(order))
        sync()
    tokens = sum(len(c.tokens) for b in timed for c in b)
    return {
        "batch_tokens": batch_tokens,
        "batches": len(batches),
        "ms_per_step": round(step_s * 1e3, 2),
        "ms_record_features_per_step": round(features_s * 1e3, 2),
        "steps_per_s": round(1 / step_s, 2),
        "tokens_per_s": round(tokens / (step_s * a.steps)),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "kernels": prof.key_averages().table(
            sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25
        ),
    }


if __name__ == "__main__":
    main()
