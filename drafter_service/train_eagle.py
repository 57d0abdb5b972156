"""`specwire train-eagle`: self-distil an EAGLE head from the target model within a time budget.

1. Data (a --gen-fraction of --max-minutes): the target writes new instructions from the seed tasks
   (self-instruct, degenerate and near-duplicate ones dropped), answers seed + new prompts (greedy and
   T = 0.7), and its features are recorded. Every source holds out its own share (stratified) before it is
   used, and no source exceeds --max-source-share of the training (or held-out) prompts, so one large file
   (GSM8K) cannot dominate the head or flatter its held-out numbers.
2. Training (the rest): EAGLE's losses on the head's output at every response position: smooth-L1 regression
   onto the target's next feature (EAGLE-1 only) + 0.1 x cross-entropy against the target's next-token
   distribution (EAGLE-3: restricted to the draft vocabulary). A second, unrolled pass feeds the head its own
   shifted outputs as features (what drafting steps 2..k see), weighted by --unroll-weight.
3. Each epoch: held-out top-1 agreement with the target (step 1 and self-fed step 2), overall and per source.
   Always saves the head (config.json + model.safetensors, published key names, bf16) and train_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from specwire.drafter.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    save_eagle_head,
    shared_target_weights,
)
from specwire.drafter.self_distill import (
    GENERATED_SOURCE,
    Prompt,
    Sample,
    cap_source_shares,
    distill,
    interleave,
    load_seed_prompts,
    split_per_source,
    write_instructions,
)
from tqdm import tqdm

from specwire.config import default_aux_layers
from specwire.default_model import resolve_model_path
from specwire.engine import TargetEngine, default_device, parse_device
from specwire.model import KVCache
from specwire.tokenizer import load_tokenizer
from specwire.weights import load_checkpoint

DEFAULT_OUT = "drafter_service/heads/smollm2-135m-eagle"
FEATURE_LOSS_WEIGHT, TOKEN_LOSS_WEIGHT = 1.0, 0.1  # EAGLE's v_w and p_w
INSTRUCT_SHARE = 0.4  # of the data budget for writing instructions; answering them is the rest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--data-dir", required=True, help="folder with prompts/*.jsonl (read only, nothing copied)"
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"head directory to write (default {DEFAULT_OUT})")
    p.add_argument("--arch", choices=["eagle1", "eagle3"], default="eagle1")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="total time budget (default 8)")
    p.add_argument(
        "--gen-fraction", type=float, default=0.5, help="share of the budget for data (default 0.5)"
    )
    p.add_argument("--max-prompts", type=int, default=0, help="cap on seed prompts used (0 = all)")
    p.add_argument("--self-instruct", type=int, default=4000, help="new instructions to write (default 4000)")
    p.add_argument(
        "--max-source-share",
        type=float,
        default=0.5,
        help="most any one prompt source may make of the training and held-out prompts (default 0.5: with "
        "two large sources, GSM8K and the written instructions, a lower cap shrinks both to a few hundred)",
    )
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument(
        "--sample-fraction", type=float, default=0.5, help="responses sampled at T=0.7, not greedy"
    )
    p.add_argument("--gen-batch", type=int, help="concurrent generations (default 128 on cuda, 8 on cpu)")
    p.add_argument(
        "--holdout", type=float, default=0.03, help="held-out share of each source's prompts (default 0.03)"
    )
    p.add_argument(
        "--epochs", type=int, default=100, help="maximum epochs; the time budget usually ends first"
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default 8192 on cuda, 512 on cpu)")
    p.add_argument("--max-seq-len", type=int, default=768)
    p.add_argument(
        "--unroll-weight", type=float, default=0.5, help="loss weight of the self-fed pass (0 = off)"
    )
    p.add_argument(
        "--feature-noise", type=float, default=0.05, help="uniform noise on input features (x RMS)"
    )
    p.add_argument("--draft-vocab", type=int, default=16384, help="EAGLE-3 draft vocabulary size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--write-heldout", metavar="FILE", help="also write the held-out prompts as JSONL (for bench)"
    )


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if not 0 < args.gen_fraction < 1:
        raise ValueError(f"--gen-fraction must be in (0, 1), got {args.gen_fraction}")
    if args.max_minutes <= 0:
        raise ValueError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    if not 0 < args.max_source_share <= 1:
        raise ValueError(f"--max-source-share must be in (0, 1], got {args.max_source_share}")
    budget = args.max_minutes * 60
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    seeds = load_seed_prompts(args.data_dir)
    engine = _engine(args)
    cuda = engine.device.type == "cuda"
    gen_batch = args.gen_batch or (128 if cuda else 8)

    # ---------------------------------------------------------------- data
    tagged = interleave(seeds, rng)[: args.max_prompts or None]
    by_source = {name: [p.text for p in tagged if p.source == name] for name in seeds}
    held_by, train_by = split_per_source(by_source, args.holdout)  # before any seed task is shown as example
    new, verdicts = [], Counter()
    instruction_seeds = train_by.get("self_instruct_seed_tasks", [])
    if args.self_instruct and instruction_seeds:
        instruct_deadline = t0 + budget * args.gen_fraction * INSTRUCT_SHARE
        known = [p for group in seeds.values() for p in group]
        new, verdicts = write_instructions(
            engine, instruction_seeds, args.self_instruct, rng, instruct_deadline, gen_batch, known
        )
    held_new, train_new = split_per_source({GENERATED_SOURCE: new}, args.holdout)
    available = {**{k: len(v) for k, v in by_source.items()}, GENERATED_SOURCE: len(new)}
    held_prompts = interleave(cap_source_shares(held_by | held_new, args.max_source_share), rng)
    train_prompts = interleave(cap_source_shares(train_by | train_new, args.max_source_share), rng)
    if not held_prompts:
        raise ValueError(f"--holdout {args.holdout} holds out no prompt: the prompt files are too small")
    if args.write_heldout:
        lines = [json.dumps({"prompt": p.text, "source": p.source}) for p in held_prompts]
        Path(args.write_heldout).write_text("\n".join(lines) + "\n")
    gen_deadline = t0 + budget * args.gen_fraction
    distill_args = (args.max_new_tokens, args.sample_fraction, rng, gen_deadline, gen_batch)
    held = distill(engine, held_prompts, *distill_args, "held-out")
    train = distill(engine, train_prompts, *distill_args, "distill")
    if not train or not held:
        raise ValueError(f"--max-minutes {args.max_minutes} left no time to generate training data")
    gen_seconds = time.monotonic() - t0

    # ---------------------------------------------------------------- train
    head = _new_head(args, engine, train)
    trainer = Trainer(head, engine, args, cuda)
    train_deadline = t0 + budget - min(15.0, 0.05 * budget)  # keep time to save
    history = trainer.fit(train, held, train_deadline)
    out = Path(args.out)
    log = {
        "arch": args.arch,
        "model": str(args.model or "default SmolLM2-135M-Instruct"),
        "data": {
            "seed_prompt_files": {k: len(v) for k, v in seeds.items()},
            "self_instruct": {"requested": args.self_instruct, "written": len(new), **verdicts},
            "max_source_share": args.max_source_share,
            "prompts_per_source": _source_counts(available, held_prompts, train_prompts, held, train),
            "train_conversations": len(train),
            "held_out_conversations": len(held),
            "train_tokens": sum(len(s.tokens) for s in train),
            "train_response_tokens": sum(len(s.tokens) - s.prompt_len for s in train),
            "max_new_tokens": args.max_new_tokens,
            "sample_fraction_t0.7": args.sample_fraction,
        },
        "steps": trainer.steps,
        "epochs": len(history),
        "generation_seconds": round(gen_seconds, 1),
        "training_seconds": round(time.monotonic() - t0 - gen_seconds, 1),
        "machine": {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("run",)},
        "held_out": history,
    }
    save_eagle_head(
        head,
        out,
        extra={
            "target_tokenizer": engine.tokenizer.fingerprint,
            "held_out": _without_sources(history[-1]) if history else None,
        },
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
    print(json.dumps({"out": str(out), "steps": trainer.steps, "held_out": history[-1] if history else None}))
    return 0


def _source_counts(
    available: dict[str, int],
    held_prompts: list[Prompt],
    train_prompts: list[Prompt],
    held: list[Sample],
    train: list[Sample],
) -> dict[str, dict]:
    """Per source: prompts available, held out and used for training (after the cap), conversations distilled
    (a deadline may cut training ones off) and the source's share of the distilled training conversations."""
    counts = {}
    for name, n in available.items():
        n_train = sum(s.source == name for s in train)
        counts[name] = {
            "available": n,
            "held_out_prompts": sum(p.source == name for p in held_prompts),
            "train_prompts": sum(p.source == name for p in train_prompts),
            "held_out_conversations": sum(s.source == name for s in held),
            "train_conversations": n_train,
            "train_share": round(n_train / max(len(train), 1), 4),
        }
    return counts


def _without_sources(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "per_source"}


def _engine(args: argparse.Namespace) -> TargetEngine:
    """The target with a tokenizer, graphs for generation and (EAGLE-3) its aux taps."""
    path = resolve_model_path(args.model)
    config, state_dict = load_checkpoint(path)
    device = parse_device(args.device) if args.device else default_device()
    aux = default_aux_layers(config.num_layers) if args.arch == "eagle3" else ()
    engine = TargetEngine(
        device=device,
        max_slots=args.gen_batch or (128 if device.type == "cuda" else 8),
        max_context=min(1024, config.max_position_embeddings),
        aux_layers=aux,
        max_prefill_tokens=32768 if device.type == "cuda" else 4096,
        checkpoint=(config, state_dict),
    )
    engine.tokenizer = load_tokenizer(path)
    return engine


def _new_head(args: argparse.Namespace, engine: TargetEngine, train: list[Sample]) -> EagleHead:
    target = engine.config
    config = EagleHeadConfig.for_target(target, args.arch, args.draft_vocab)
    head = EagleHead(
        config, shared_target_weights(engine.model), torch.float32, engine.device, engine.max_context
    )
    head.init_weights(args.seed)
    if args.arch == "eagle3":
        head.draft_to_target.copy_(_frequent_tokens(train, config.draft_vocab_size, target.vocab_size))
    head.requires_grad_(False)
    for p in head.trainable_parameters().values():
        p.requires_grad_(True)
    return head


def _frequent_tokens(train: list[Sample], size: int, vocab: int) -> torch.Tensor:
    """The draft vocabulary: the `size` most frequent tokens of the distilled text, ascending (EAGLE-3)."""
    counts = Counter(t for s in train for t in s.tokens.tolist())
    chosen = [t for t, _ in counts.most_common(size)]
    chosen += [t for t in range(vocab) if t not in set(chosen)][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


class Trainer:
    def __init__(self, head: EagleHead, engine: TargetEngine, args: argparse.Namespace, cuda: bool):
        self.head, self.engine, self.args, self.cuda = head, engine, args, cuda
        self.batch_tokens = args.batch_tokens or (8192 if cuda else 512)
        params = list(head.trainable_parameters().values())
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.steps = 0

    def fit(self, train: list[Sample], held: list[Sample], deadline: float) -> list[dict]:
        """Epochs until `deadline` or --epochs; evaluates the held-out set after each one."""
        # The reference ops are differentiable; the Triton kernels are not.
        previous, os.environ["SPECWIRE_TORCH_OPS"] = os.environ.get("SPECWIRE_TORCH_OPS"), "1"
        try:
            start, history = time.monotonic(), []
            for epoch in range(self.args.epochs):
                batches = self._batches(train, shuffle=True)
                for batch in tqdm(batches, desc=f"epoch {epoch + 1}", unit="step"):
                    if time.monotonic() > deadline:
                        break
                    progress = (time.monotonic() - start) / max(deadline - start, 1e-9)
                    self._step(batch, progress)
                else:
                    history.append({"epoch": epoch + 1, "step": self.steps, **self.evaluate(held)})
                    tqdm.write(json.dumps(history[-1]))
                    continue
                history.append(
                    {"epoch": epoch + 1, "step": self.steps, "partial": True, **self.evaluate(held)}
                )
                tqdm.write(json.dumps(history[-1]))
                break
            return history
        finally:
            if previous is None:
                os.environ.pop("SPECWIRE_TORCH_OPS")
            else:
                os.environ["SPECWIRE_TORCH_OPS"] = previous

    def _batches(self, samples: list[Sample], shuffle: bool) -> list[list[Sample]]:
        """Length-sorted batches of about batch_tokens padded tokens each, in random order."""
        ordered = sorted(samples, key=lambda s: len(s.tokens))
        batches, current = [], []
        for s in ordered:
            width = min(len(s.tokens), self.args.max_seq_len)
            if current and width * (len(current) + 1) > self.batch_tokens:
                batches.append(current)
                current = []
            current.append(s)
        if current:
            batches.append(current)
        if shuffle:
            random.shuffle(batches)
        return batches

    def _step(self, batch: list[Sample], progress: float) -> None:
        warmup = min(1.0, (self.steps + 1) / 50)
        lr = self.args.lr * warmup * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            losses = self._losses(batch, noise=self.args.feature_noise)
        loss = losses["loss"]
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], 0.5)
        self.optimizer.step()
        self.steps += 1

    def _inputs(self, batch: list[Sample]) -> dict[str, torch.Tensor]:
        """Head position t: token t + 1 with the feature of t; targets: feature and distribution of t + 1."""
        dev, eagle3 = self.head.device, self.head.config.arch == "eagle3"
        lengths = [min(len(s.tokens), self.args.max_seq_len) for s in batch]
        T = max(lengths) - 1
        B = len(batch)
        ids = torch.zeros(B, T, dtype=torch.int64)
        feats = torch.zeros(B, T, self.head.config.feature_dim, device=dev)
        target = torch.zeros(B, T, self.head.config.layer.hidden_size, device=dev)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b, (s, n) in enumerate(zip(batch, lengths, strict=True)):
            ids[b, : n - 1] = s.tokens[1:n]
            feats[b, : n - 1] = (s.aux if eagle3 else s.hidden)[: n - 1].float()
            target[b, : n - 1] = s.hidden[1:n].float()
            mask[b, max(s.prompt_len - 2, 0) : n - 1] = True  # positions that predict response tokens
        return {
            "ids": ids.to(dev),
            "feats": feats,
            "target": target,
            "mask": mask.to(dev),
            "num_tokens": torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device=dev),
        }

    def _forward(self, x: dict[str, torch.Tensor], feats: torch.Tensor, own: bool) -> torch.Tensor:
        B, T = x["ids"].shape
        cache = KVCache.allocate(self.head.config.layer, B, T, torch.float32, self.head.device)
        zeros = torch.zeros(B, dtype=torch.int32, device=self.head.device)
        slots = torch.arange(B, dtype=torch.int32, device=self.head.device)
        return self.head(
            x["ids"], feats, zeros, x["num_tokens"], slots, cache.k[0], cache.v[0], own_features=own
        )

    def _losses(self, batch: list[Sample], noise: float) -> dict[str, torch.Tensor]:
        head, x = self.head, self._inputs(batch)
        eagle3 = head.config.arch == "eagle3"
        feats = x["feats"]
        if noise:
            rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
            feats = feats + (torch.rand_like(feats) - 0.5) * 2 * noise * rms
        with torch.no_grad():
            target_logits = self.engine.model.lm_head(x["target"].to(self.engine.dtype)).float()
            if eagle3:
                target_logits = target_logits[..., head.draft_to_target]
            target_p = torch.softmax(target_logits, -1)
        mask = x["mask"].float()
        out = self._forward(x, feats, own=False)
        passes = [(out, mask, 1.0)]
        if self.args.unroll_weight > 0:  # position t gets the head's own prediction of feature t
            first = head.fc(feats[:, :1]) if eagle3 else feats[:, :1]
            shifted = torch.cat([first, out[:, :-1]], dim=1)
            unrolled = self._forward(x, shifted, own=eagle3)
            second_mask = mask.clone()
            second_mask[:, 0] = 0
            passes.append((unrolled, second_mask, self.args.unroll_weight))
        total, result = 0.0, {}
        for i, (o, m, weight) in enumerate(passes):
            denom = m.sum().clamp_min(1.0)
            logp = torch.log_softmax(head.logits(o), -1)
            token_loss = -((target_p * logp).sum(-1) * m).sum() / denom
            loss = TOKEN_LOSS_WEIGHT * token_loss
            if not eagle3:
                feature_loss = (
                    F.smooth_l1_loss(o.float(), x["target"], reduction="none").mean(-1) * m
                ).sum() / denom
                loss = loss + FEATURE_LOSS_WEIGHT * feature_loss
            agree = ((logp.argmax(-1) == target_p.argmax(-1)).float() * m).sum() / denom
            result |= {f"loss_{i + 1}": loss.detach(), f"top1_{i + 1}": agree.detach()}
            total = total + weight * loss
        result["loss"], result["positions"] = total, mask.sum()
        return result

    @torch.no_grad()
    def evaluate(self, held: list[Sample]) -> dict:
        """Held-out metrics over all held-out conversations and, under "per_source", for each source."""
        by_source: dict[str, list[Sample]] = defaultdict(list)
        for s in held:
            by_source[s.source].append(s)
        sums = {name: self._metric_sums(group) for name, group in sorted(by_source.items())}
        total: Counter = Counter()
        for part in sums.values():
            total.update(part)  # update() keeps zero sums, unlike +
        return {**_metrics(total), "per_source": {name: _metrics(part) for name, part in sums.items()}}

    def _metric_sums(self, samples: list[Sample]) -> Counter:
        """Position-weighted sums of the losses and top-1 agreements, and the number of positions ("n")."""
        sums: Counter = Counter()
        for batch in self._batches(samples, shuffle=False):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
                r = self._losses(batch, noise=0.0)
            n = float(r.pop("positions"))
            r.pop("loss")
            sums["n"] += n
            for k, v in r.items():
                sums[k] += float(v) * n
        return sums


def _metrics(sums: Counter) -> dict[str, float]:
    """Token-weighted loss and top-1 agreement with the target at step 1 and (self-fed) step 2; the
    acceptance-length proxy 1 + a1 + a1 a2 + a1 a2^2 + a1 a2^3 assumes step 2's rate for steps 3-4."""
    metrics = {k: round(v / max(sums["n"], 1), 4) for k, v in sums.items() if k != "n"}
    a1, a2 = metrics.get("top1_1", 0.0), metrics.get("top1_2", metrics.get("top1_1", 0.0))
    metrics["acceptance_length_proxy_k4"] = round(1 + a1 * (1 + a2 + a2**2 + a2**3), 3)
    metrics["positions"] = int(sums["n"])  # how much each number rests on
    return metrics
