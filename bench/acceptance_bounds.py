"""What holds a draft head's acceptance back: the head, the draft vocabulary, or the top-K cut of q.

The target answers held-out chat questions (greedy, or sampled at T = 1); the head is unrolled over each
answer as in training (drafter_service.ttt: step j sees its own earlier outputs, teacher-forced tokens), and
at every response position and draft step j this reports, on the target's own vocabulary:
  overlap      sum min(p, q): the chance a draft sampled from the head's q is accepted (T = 1);
  overlap_topK the same with q cut to its top K and renormalised (what the drafter ships, --draft-top-k);
  in_vocab     p's mass on the draft vocabulary: the overlap of a perfect head with that vocabulary;
  top1         whether the head's argmax is the target's (what greedy acceptance needs, T = 0);
  overlap_topK_scaleC (--q-scales) the widest cut's overlap with q from the logits / C: is q calibrated?
each chained into an acceptance-length proxy for k = 4: 1 + a1 + a1 a2 + ... (independence assumed).
With greedy answers it also replays the k = 4 chain the drafter runs (chain_replay, drafter_service.
chain_visits): a round starts where the last one's bonus token fell, so drafting starts right after a miss
more often than at a random anchor. The replay's acceptance length is what `specwire bench --local`
measures at T = 0 on the same answers; its first position's rate (top-1 at the rounds' starts) against
top1[0] at every anchor measures that selection.
p is the target's T = 1 distribution; with --temperature 0 (greedy answers) only top1 describes acceptance.

    python bench/acceptance_bounds.py --limit 48 --max-tokens 64 --temperature 1 --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from collections import Counter

import torch
from specwire.drafter.chain_visits import anchor_acceptance, chain_metrics, chain_sums, drafted_anchors
from specwire.drafter.eagle_head import load_eagle_head, shared_target_weights
from specwire.drafter.eagle_trainer import Trainer, chain_length
from specwire.drafter.self_distill import Conversation, Prompt, distill, record_features
from specwire.drafter.train_eagle import DEFAULT_OUT, add_arguments, code_commit
from specwire.drafter.ttt import step_mask, unroll

from specwire.config import default_aux_layers
from specwire.default_model import resolve_model_path
from specwire.engine import TargetEngine
from specwire.tokenizer import load_tokenizer
from specwire.weights import load_checkpoint

K = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=DEFAULT_OUT)
    p.add_argument("--prompts", default="bench/data/heldout_chat_sharegpt.jsonl")
    p.add_argument("--limit", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="of the target's answers (0: greedy)")
    p.add_argument("--top-k", default="16,32,64", help="q cuts to report")
    p.add_argument("--q-scales", default="", help="also q from the head's logits / c for these c, cut to the "
                   "widest top-K (overlap_top{K}_scale{c}): is the head's q calibrated?")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    return p.parse_args()


def held_out_engine(model: str | None, device: str) -> TargetEngine:
    """The target with its EAGLE-3 taps and its tokenizer, to answer held-out questions."""
    path = resolve_model_path(model)
    config, state_dict = load_checkpoint(path)
    engine = TargetEngine(
        device=device,
        max_slots=16,
        max_context=1024,
        aux_layers=default_aux_layers(config.num_layers),
        checkpoint=(config, state_dict),
    )
    engine.tokenizer = load_tokenizer(path)
    return engine


def held_out_answers(engine: TargetEngine, prompts_file: str, limit: int, max_tokens: int, temperature: float,
                     seed: int) -> list[Conversation]:
    """The target's answers to the first `limit` questions of prompts_file, all greedy or all sampled."""
    with open(prompts_file) as f:
        lines = f.read().splitlines()[:limit]
    prompts = [Prompt("heldout", json.loads(line)["prompt"]) for line in lines]
    sampled = 1.0 if temperature > 0 else 0.0  # the share of answers sampled, not greedy
    no_deadline = time.monotonic() + 1e9
    return distill(engine, prompts, max_tokens, sampled, temperature or 1.0, random.Random(seed), no_deadline,
                   16, "answers")


def provenance(engine: TargetEngine, head: str) -> dict:
    """The command, date, machine, commit and head of this run, for its result file."""
    return {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "commit": code_commit(),
        "head": head,
    }


def overlap_top_k(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """sum min(p, q') per row, q' = q cut to its top k and renormalised (what the drafter ships)."""
    top, idx = q.topk(min(k, q.shape[-1]), -1)
    return torch.minimum(p.gather(-1, idx), top / top.sum(-1, keepdim=True)).sum(-1)


@torch.no_grad()
def main() -> None:
    a = parse_args()
    engine = held_out_engine(a.model, a.device)
    head = load_eagle_head(
        a.head, engine.config, shared_target_weights(engine.model), torch.float32, engine.device, 1024
    )
    conversations = held_out_answers(engine, a.prompts, a.limit, a.max_tokens, a.temperature, a.seed)
    train_args = argparse.ArgumentParser()
    add_arguments(train_args)
    trainer = Trainer(head, engine, train_args.parse_args(["--ttt-steps", str(K)]), cuda=False)
    cuts = [int(k) for k in a.top_k.split(",")]
    scales = [float(c) for c in a.q_scales.split(",") if c]
    sums: dict[str, list[float]] = {}
    positions = [0.0] * K
    chain: Counter = Counter()  # chain_sums of the replayed rounds (T = 0)
    for batch in trainer._batches(conversations, epoch=None):
        x = trainer._inputs(record_features(engine, [conversations[i] for i in batch]))
        p = torch.softmax(engine.model.lm_head(x["target"].to(engine.dtype)).float(), -1)
        p_in = p[..., head.draft_to_target]  # the target's probabilities of the draft vocabulary's tokens
        step_logits = [head.logits(out) for out in unroll(head, x["ids"], x["feats"], K)]
        if a.temperature == 0:
            hits = [head.draft_to_target[lg.argmax(-1)] == p.argmax(-1) for lg in step_logits]
            chain.update(chain_sums(anchor_acceptance(hits, K), drafted_anchors(x["mask"])))
        for j, all_logits in enumerate(step_logits):
            m = step_mask(x["mask"], j)
            logits = all_logits[m]
            q = torch.softmax(logits, -1)
            pj, pin = p[m], p_in[m]
            values = {
                "overlap": torch.minimum(pin, q).sum(-1),
                "in_vocab": pin.sum(-1),
                "top1": (head.draft_to_target[q.argmax(-1)] == pj.argmax(-1)).float(),
            }
            for k in cuts:
                values[f"overlap_top{k}"] = overlap_top_k(pin, q, k)
            for c in scales:
                values[f"overlap_top{max(cuts)}_scale{c}"] = overlap_top_k(pin, torch.softmax(logits / c, -1),
                                                                           max(cuts))
            for name, v in values.items():
                sums.setdefault(name, [0.0] * K)[j] += float(v.sum())
            positions[j] += float(m.sum())
    per_step = {
        name: [round(s / max(n, 1), 4) for s, n in zip(v, positions, strict=True)] for name, v in sums.items()
    }
    proxy = {name: round(chain_length(rates), 3) for name, rates in per_step.items()}
    result = {
        **provenance(engine, a.head),
        "answers": {"temperature": a.temperature, "conversations": len(conversations)},
        **({"chain_replay": chain_metrics(chain)} if chain else {}),
        "positions_per_step": [int(n) for n in positions],
        "per_step": per_step,
        "acceptance_length_proxy_k4": proxy,
    }
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
