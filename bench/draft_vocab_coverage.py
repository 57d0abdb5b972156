"""How much of the target's answers a draft vocabulary reaches, and what a larger one would add.

The target answers held-out chat questions (greedy and at T = 1). On the second half of the answers this
reports, for the head's draft vocabulary and for larger ones, the target's mean probability mass on the
vocabulary (at T = 1 the best a head with it can be accepted at a step) and the share of the answers' tokens
it holds (at T = 0 the greedy tokens a head with it can draft at all). A larger vocabulary is the head's
tokens plus the most probable others by the target's summed probability over the first half of the answers
(the held-out second half keeps the estimate honest); `--draft-vocab N` on a warm start grows a head this
way, choosing its new tokens by frequency in the whole training set instead.

    python bench/draft_vocab_coverage.py --limit 96 --max-tokens 64 --sizes 12288,16384,24576 --out FILE.json
"""

from __future__ import annotations

import argparse
import json

import torch
from acceptance_bounds import held_out_answers, held_out_engine, provenance
from specwire.drafter.draft_vocab import t2d_mask
from specwire.drafter.eagle_head import load_eagle_head, shared_target_weights
from specwire.drafter.self_distill import record_features
from specwire.drafter.train_eagle import DEFAULT_OUT

from specwire.engine import TargetEngine


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=DEFAULT_OUT, help="EAGLE-3 head whose draft vocabulary is the base")
    p.add_argument("--prompts", default="bench/data/heldout_chat_sharegpt.jsonl")
    p.add_argument("--limit", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sizes", default="12288,16384,24576", help="larger vocabulary sizes to report")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    return p.parse_args()


def answer_distributions(engine: TargetEngine, a: argparse.Namespace, temperature: float
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per answer: the target's next-token distributions [n, V] over its response, and the response's ids."""
    answers = held_out_answers(engine, a.prompts, a.limit, a.max_tokens, temperature, a.seed)
    weight = engine.model.lm_head.weight.float()
    probs, tokens = [], []
    for s in record_features(engine, answers):
        probs.append(torch.softmax(s.hidden[s.prompt_len - 1 : -1].float() @ weight.T, -1).cpu())
        tokens.append(s.tokens[s.prompt_len :].cpu())
    return probs, tokens


def reach(inside: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor) -> dict:
    """The vocabulary `inside` (a [V] mask): the mean mass of the distributions probs [n, V] on it, and the
    share of tokens [n] in it."""
    return {"mass": round(float(probs[:, inside].sum(-1).mean()), 4),
            "tokens": round(float(inside[tokens].float().mean()), 4)}


@torch.no_grad()
def main() -> None:
    a = parse_args()
    engine = held_out_engine(a.model, a.device)
    head = load_eagle_head(a.head, engine.config, shared_target_weights(engine.model), torch.float32,
                           engine.device, 1024)
    base = t2d_mask(head.draft_to_target.cpu(), engine.config.vocab_size)
    sizes = [int(n) for n in a.sizes.split(",")]
    result = {**provenance(engine, a.head), "by_temperature": {}}
    for temperature in (0.0, 1.0):
        probs, tokens = answer_distributions(engine, a, temperature)
        half = len(probs) // 2
        mass_first = torch.cat(probs[:half]).sum(0)
        held = torch.cat(probs[half:]), torch.cat(tokens[half:])
        rows = {str(int(base.sum())): reach(base, *held)}
        others = torch.where(base, -1.0, mass_first).argsort(descending=True)  # the base's tokens last
        for n in sizes:
            grown = base.clone()
            grown[others[: n - int(base.sum())]] = True
            rows[str(n)] = reach(grown, *held)
        result["by_temperature"][f"T={temperature:g}"] = {"positions": int(held[1].numel()), "sizes": rows}
        print(f"T = {temperature:g}:", json.dumps(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
