"""`specwire train-eagle`: self-distil an EAGLE head (EAGLE-3 by default) from the target model.

1. Data (a --gen-fraction of --max-minutes): prompts from --data-dir (self-instruct seed tasks, GSM8K,
   HumanEval), ShareGPT human turns (--chat-prompts, token ids made by `python -m specwire.drafter.sharegpt`)
   and instructions the target writes itself (self-instruct). Every source holds out its own share before it
   is used (ShareGPT: whole conversations, fixed by id); no source exceeds --max-source-share. The target
   answers every prompt, greedy or at --sample-temperature. Only token ids are kept: features are recomputed
   on every training batch, so the data set is small enough to checkpoint.
2. The draft vocabulary (EAGLE-3): the --draft-vocab tokens the target writes most in its training answers;
   train_log.json reports the share of response tokens it covers (training and held-out).
3. Training (the rest of the budget; see eagle_trainer): training-time test over --ttt-steps draft steps,
   forward KL to the target's distribution (and --tv-weight x the total variation). With --checkpoint DIR
   the data and the training state are saved there, and --resume continues a run exactly where it stopped
   (in a later session, too).
Always writes the head (config.json + model.safetensors, published key names, bf16) and train_log.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from specwire.drafter.draft_vocab import choose_draft_vocab, coverage
from specwire.drafter.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    grow_draft_vocab,
    load_eagle_head,
    save_eagle_head,
    shared_target_weights,
    widen_attention,
    widen_mlp,
    with_attention_heads,
)
from specwire.drafter.eagle_trainer import Trainer
from specwire.drafter.self_distill import (
    GENERATED_SOURCE,
    Conversation,
    Prompt,
    cap_source_shares,
    distill,
    interleave,
    load_seed_prompts,
    split_per_source,
    tag,
    write_instructions,
)
from specwire.drafter.sharegpt import load_prompt_ids
from specwire.drafter.token_store import load_token_lists, save_token_lists

from specwire.config import ModelConfig, default_aux_layers
from specwire.default_model import resolve_model_path
from specwire.engine import TargetEngine, default_device, parse_device
from specwire.tokenizer import load_tokenizer
from specwire.weights import load_checkpoint

DEFAULT_OUT = "drafter_service/heads/smollm2-135m-eagle"
DEFAULT_DRAFT_VOCAB = 8192
INSTRUCT_SHARE = 0.25  # of the data budget for writing instructions; answering prompts is the rest
DATA_FILE, DATA_LOG = "data.npz", "data.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data-dir", help="folder with prompts/*.jsonl (read only, nothing copied)")
    p.add_argument(
        "--chat-prompts", help="ShareGPT prompt ids (.npz from python -m specwire.drafter.sharegpt)"
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"head directory to write (default {DEFAULT_OUT})")
    p.add_argument("--arch", choices=["eagle1", "eagle3"], default="eagle3")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="this invocation's time budget (default 8)")
    p.add_argument(
        "--gen-fraction", type=float, default=0.5, help="share of the budget for data (default 0.5)"
    )
    p.add_argument("--max-prompts", type=int, default=0, help="cap on prompts per source (0 = all)")
    p.add_argument("--self-instruct", type=int, default=4000, help="new instructions to write (default 4000)")
    p.add_argument(
        "--max-source-share",
        type=float,
        default=0.5,
        help="most any one prompt source may make of the training and held-out prompts (default 0.5)",
    )
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--sample-fraction", type=float, default=0.5, help="share of answers sampled, not greedy")
    p.add_argument(
        "--answers-per-prompt", type=int, default=1,
        help="answers the target writes to each training prompt: the first greedy or sampled by "
        "--sample-fraction, the others sampled (a second greedy one would repeat it); held-out prompts get "
        "one",
    )  # fmt: skip
    p.add_argument("--sample-temperature", type=float, default=1.0, help="temperature of sampled answers")
    p.add_argument("--gen-batch", type=int, help="concurrent generations (default 128 on cuda, 8 on cpu)")
    p.add_argument("--holdout", type=float, default=0.03, help="held-out share of each source (default 0.03)")
    p.add_argument("--max-heldout", type=int, default=200, help="most held-out conversations per source")
    p.add_argument(
        "--epochs", type=int, default=100, help="maximum epochs; the time budget usually ends first"
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument(
        "--total-steps",
        type=int,
        default=-1,
        help="steps of the cosine schedule, and a stop (0: constant rate after warm-up, no stop; -1, the "
        "default: fitted to --max-minutes from the step rate measured at the start, kept on --resume)",
    )
    p.add_argument("--stop-after-steps", type=int, default=0, help="stop this invocation after N steps")
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default 8192 on cuda, 512 on cpu)")
    p.add_argument("--max-seq-len", type=int, default=768)
    p.add_argument("--ttt-steps", type=int, default=7, help="draft steps unrolled in training (EAGLE-3: 7)")
    p.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of step j is decay**j")
    p.add_argument(
        "--feature-noise", type=float, default=0.05, help="uniform noise on input features (x RMS)"
    )
    p.add_argument(
        "--tv-weight",
        type=float,
        default=0.0,
        help="weight of a total-variation term 1 - sum min(p, q) beside the forward KL: it aims at sampled "
        "(T = 1) acceptance directly (default 0: KL only)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help=f"EAGLE-3 draft vocabulary size (default 0: {DEFAULT_DRAFT_VOCAB} for a new head, --init-head's "
        "own for a warm start); larger than --init-head's grows it: the most frequent response tokens, the "
        "new ones' output rows mapped from the target's",
    )
    p.add_argument(
        "--head-attention-heads",
        type=int,
        default=0,
        help="the head's attention heads (default 0: the target's for a new head, --init-head's own for a "
        "warm start); more than --init-head's grows it keeping what it computes (new heads start silent); "
        "key/value heads follow, in the target's grouping",
    )
    p.add_argument(
        "--head-intermediate-size",
        type=int,
        default=0,
        help="the head's MLP width (default 0: the target's for a new head, --init-head's own for a warm "
        "start); wider than --init-head's grows it keeping what it computes (new units start silent)",
    )
    p.add_argument("--checkpoint", help="folder for the data and training checkpoints (resumable)")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --checkpoint")
    p.add_argument(
        "--init-head",
        help="start from this head's weights and draft vocabulary (e.g. the shipped head, when the run's "
        "checkpoint stayed on another machine); fresh optimizer",
    )
    p.add_argument("--log-every", type=int, default=50, help="steps between training-curve points")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-heldout", metavar="FILE", help="also write held-out text prompts as JSONL")


def _validate(args: argparse.Namespace) -> None:
    if not 0 < args.gen_fraction < 1:
        raise ValueError(f"--gen-fraction must be in (0, 1), got {args.gen_fraction}")
    if args.max_minutes <= 0:
        raise ValueError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    if not 0 < args.max_source_share <= 1:
        raise ValueError(f"--max-source-share must be in (0, 1], got {args.max_source_share}")
    if args.answers_per_prompt < 1:
        raise ValueError(f"--answers-per-prompt must be >= 1, got {args.answers_per_prompt}")
    if args.tv_weight < 0:
        raise ValueError(f"--tv-weight must be >= 0, got {args.tv_weight}")
    if args.ttt_steps < 1:
        raise ValueError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    if args.head_intermediate_size < 0 or args.head_attention_heads < 0:
        raise ValueError(f"--head-intermediate-size and --head-attention-heads must be >= 0, got "
                         f"{args.head_intermediate_size} and {args.head_attention_heads}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint DIR")
    if not args.resume and not (args.data_dir or args.chat_prompts):
        raise ValueError("give --data-dir and/or --chat-prompts (or --resume a checkpointed run)")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    _validate(args)
    budget = args.max_minutes * 60
    torch.manual_seed(args.seed)
    engine = _engine(args)
    cuda = engine.device.type == "cuda"
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if args.resume:
        train, held, data_log = load_data(ckpt)
    else:
        train, held, data_log = make_data(args, engine, t0 + budget * args.gen_fraction)
        if ckpt:
            save_data(ckpt, train, held, data_log)
    if not train or not held:
        raise ValueError(f"--max-minutes {args.max_minutes} left no time to generate training data")
    gen_seconds = time.monotonic() - t0

    head = _new_head(args, engine, train)
    trainer = Trainer(head, engine, args, cuda)
    if args.resume and (ckpt / "state").is_dir():
        trainer.restore(ckpt / "state")
    vocab_log = _vocab_log(head, train, held)
    reserve = min(90.0, max(15.0, 0.06 * budget))  # for the final evaluation and saving
    trainer.fit(train, held, t0 + budget - reserve, ckpt / "state" if ckpt else None)

    out = Path(args.out)
    log = {
        "arch": args.arch,
        "command": " ".join(sys.argv),
        "commit": code_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": str(args.model or "default SmolLM2-135M-Instruct"),
        "data": data_log,
        "draft_vocab": vocab_log,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "epochs_done": trainer.epoch,
        "generation_seconds": round(gen_seconds, 1),
        "machine": {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("run",)},
        "sessions": trainer.sessions,
        "held_out": trainer.history,
        "curve": trainer.curve,
    }
    last = trainer.last_held_out()
    save_eagle_head(head, out, extra={"target_tokenizer": engine.tokenizer.fingerprint, "held_out": last})
    (out / "train_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
    print(json.dumps({"out": str(out), "steps": trainer.step, "held_out": last}))
    return 0


# ------------------------------------------------------------------------------------------ data


def _prompt_sources(args: argparse.Namespace) -> tuple[dict[str, list[Prompt]], dict[str, list[Prompt]]]:
    """(held-out, train) prompts per source before self-instruct: text files split per source, ShareGPT
    split by its fixed per-conversation flag."""
    rng = random.Random(args.seed)
    by_source = tag(load_seed_prompts(args.data_dir)) if args.data_dir else {}
    for prompts in by_source.values():
        rng.shuffle(prompts)
    held, train = split_per_source(by_source, args.holdout)
    if args.chat_prompts:
        for source, ids, is_held in load_prompt_ids(args.chat_prompts):
            side = held if is_held else train
            side.setdefault(source, []).append(Prompt(source, "", tuple(ids)))
        for side in (held, train):
            for prompts in side.values():
                rng.shuffle(prompts)
    cap = args.max_prompts or None
    held = {k: v[: min(args.max_heldout, cap or args.max_heldout)] for k, v in held.items()}
    return held, {k: v[:cap] for k, v in train.items()}


def make_data(
    args: argparse.Namespace, engine: TargetEngine, deadline: float
) -> tuple[list[Conversation], list[Conversation], dict]:
    """Prompts -> the target's answers (token ids), held out per source; and the data mix for the log."""
    t0 = time.monotonic()
    rng = random.Random(args.seed)
    gen_batch = engine.max_slots
    held_by, train_by = _prompt_sources(args)
    new, verdicts = [], Counter()
    seeds = [p.text for p in train_by.get("self_instruct_seed_tasks", [])]
    if args.self_instruct and seeds:
        known = [p.text for group in (*held_by.values(), *train_by.values()) for p in group if p.text]
        instruct_deadline = t0 + (deadline - t0) * INSTRUCT_SHARE
        new, verdicts = write_instructions(
            engine, seeds, args.self_instruct, rng, instruct_deadline, gen_batch, known
        )
    held_new, train_new = split_per_source(tag({GENERATED_SOURCE: new}), args.holdout)
    held_by, train_by = held_by | held_new, train_by | train_new
    available = {k: len(held_by.get(k, [])) + len(v) for k, v in train_by.items()}
    held_prompts = interleave(cap_source_shares(held_by, args.max_source_share), rng)
    train_prompts = interleave(cap_source_shares(train_by, args.max_source_share), rng)
    if not held_prompts:
        raise ValueError(f"--holdout {args.holdout} holds out no prompt: the prompt files are too small")
    if args.write_heldout:
        lines = [json.dumps({"prompt": p.text, "source": p.source}) for p in held_prompts if p.text]
        Path(args.write_heldout).write_text("\n".join(lines) + "\n")
    gen = (args.max_new_tokens, args.sample_fraction, args.sample_temperature, rng, deadline, gen_batch)
    held = distill(engine, held_prompts, *gen, "held-out")
    train = distill(engine, train_prompts, *gen, "distill")
    for n in range(2, args.answers_per_prompt + 1):  # after every first answer: a deadline cuts these first
        sampled = (args.max_new_tokens, 1.0, *gen[2:])
        train += distill(engine, train_prompts, *sampled, f"distill, answer {n}")
    log = {
        "sources": _source_counts(available, held_prompts, train_prompts, held, train),
        "self_instruct": {"requested": args.self_instruct, "written": len(new), **verdicts},
        "max_source_share": args.max_source_share,
        "train_conversations": len(train),
        "held_out_conversations": len(held),
        "train_tokens": sum(len(c.tokens) for c in train),
        "train_response_tokens": sum(len(c.tokens) - c.prompt_len for c in train),
        "max_new_tokens": args.max_new_tokens,
        "answers": {
            "per_prompt": args.answers_per_prompt,
            "sampled_share": round(sum(c.temperature > 0 for c in train) / max(len(train), 1), 4),
            "temperature": args.sample_temperature,
            "greedy_share": round(sum(c.temperature == 0 for c in train) / max(len(train), 1), 4),
        },
        "seconds": round(time.monotonic() - t0, 1),
    }
    return train, held, log


def _source_counts(
    available: dict[str, int],
    held_prompts: list[Prompt],
    train_prompts: list[Prompt],
    held: list[Conversation],
    train: list[Conversation],
) -> dict[str, dict]:
    """Per source: prompts available, held out and used for training (after the cap), conversations
    distilled (a deadline may cut training ones off) and the source's share of the training conversations."""
    counts = {}
    for name, n in available.items():
        n_train = sum(c.source == name for c in train)
        counts[name] = {
            "available": n,
            "held_out_prompts": sum(p.source == name for p in held_prompts),
            "train_prompts": sum(p.source == name for p in train_prompts),
            "held_out_conversations": sum(c.source == name for c in held),
            "train_conversations": n_train,
            "train_share": round(n_train / max(len(train), 1), 4),
        }
    return counts


def save_data(folder: Path, train: list[Conversation], held: list[Conversation], log: dict) -> None:
    """The distilled conversations as token ids (a few MB), and the data log, into the checkpoint folder."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = train + held
    save_token_lists(
        folder / DATA_FILE,
        [c.tokens for c in rows],
        prompt_len=np.asarray([c.prompt_len for c in rows], dtype=np.int32),
        source=np.asarray([c.source for c in rows]),
        temperature=np.asarray([c.temperature for c in rows], dtype=np.float64),
        held_out=np.asarray([i >= len(train) for i in range(len(rows))]),
    )
    (folder / DATA_LOG).write_text(json.dumps(log, indent=2) + "\n")


def load_data(folder: Path) -> tuple[list[Conversation], list[Conversation], dict]:
    lists, cols = load_token_lists(folder / DATA_FILE)
    temperature = cols.get("temperature", np.full(len(lists), np.nan))  # not recorded before session 21
    rows = [
        (Conversation(t, int(n), str(s), float(temp)), bool(h))
        for t, n, s, temp, h in zip(
            lists, cols["prompt_len"], cols["source"], temperature, cols["held_out"], strict=True
        )
    ]
    log = json.loads((folder / DATA_LOG).read_text())
    return [c for c, h in rows if not h], [c for c, h in rows if h], log


# ------------------------------------------------------------------------------------------ model


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


def _new_head(args: argparse.Namespace, engine: TargetEngine, train: list[Conversation]) -> EagleHead:
    """A fresh head (EAGLE-3: its draft vocabulary chosen from train), or --init-head's weights and
    vocabulary to continue from (the optimizer starts afresh: a warm start, not an exact resume)."""
    target, shared = engine.config, shared_target_weights(engine.model)
    if args.init_head:
        dev, ctx = engine.device, engine.max_context
        head = load_eagle_head(args.init_head, target, shared, torch.float32, dev, ctx)
        if head.config.arch != args.arch or head.config.aux_layers != engine.aux_layers:
            raise ValueError(
                f"--init-head {args.init_head} is {head.config.arch} with taps {head.config.aux_layers}, "
                f"not --arch {args.arch} with {engine.aux_layers}"
            )
        if args.head_intermediate_size:
            head = widen_mlp(head, args.head_intermediate_size, shared, args.seed)
        if args.head_attention_heads:
            head = widen_attention(head, args.head_attention_heads, shared, args.seed)
        if args.arch == "eagle3" and args.draft_vocab > head.config.draft_vocab_size:
            head = grow_draft_vocab(head, _frequent_responses(train, args.draft_vocab, target), shared)
    else:
        config = EagleHeadConfig.for_target(target, args.arch, args.draft_vocab or DEFAULT_DRAFT_VOCAB)
        if width := args.head_intermediate_size:
            config = replace(config, layer=replace(config.layer, intermediate_size=width))
        if heads := args.head_attention_heads:
            config = replace(config, layer=with_attention_heads(config.layer, heads))
        head = EagleHead(config, shared, torch.float32, engine.device, engine.max_context)
        head.init_weights(args.seed)
        if args.arch == "eagle3":
            head.draft_to_target.copy_(_frequent_responses(train, config.draft_vocab_size, target))
    head.requires_grad_(False)
    for p in head.trainable_parameters().values():
        p.requires_grad_(True)
    return head


def _frequent_responses(train: list[Conversation], size: int, target: ModelConfig) -> torch.Tensor:
    """The draft vocabulary: the `size` target ids most frequent in the training responses."""
    responses = (c.tokens[c.prompt_len :] for c in train)
    return choose_draft_vocab(responses, min(size, target.vocab_size), target.vocab_size)


def _vocab_log(head: EagleHead, train: list[Conversation], held: list[Conversation]) -> dict | None:
    """The draft vocabulary's size and the share of the target's response tokens it covers."""
    if head.config.arch != "eagle3":
        return None
    vocab = head.config.target_vocab_size
    return {
        "size": head.config.draft_vocab_size,
        "chosen_from": "the target's response tokens in the training conversations, by frequency",
        "train_response_coverage": round(
            coverage((c.tokens[c.prompt_len :] for c in train), head.draft_to_target, vocab), 4
        ),
        "held_out_response_coverage": round(
            coverage((c.tokens[c.prompt_len :] for c in held), head.draft_to_target, vocab), 4
        ),
    }


def code_commit() -> str:
    """The code's commit (SPECWIRE_COMMIT where the tree travelled without .git)."""
    if os.environ.get("SPECWIRE_COMMIT"):
        return os.environ["SPECWIRE_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
