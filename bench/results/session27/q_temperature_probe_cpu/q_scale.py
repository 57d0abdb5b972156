"""Probe (session 27): is the head's q at T = 1 calibrated? sum min(p, q_c) per draft step for
q_c = softmax(logits / c), top-64, on the target's T = 1 answers to 48 ShareGPT training-split first turns
(never the committed held-out chat set: that is the evaluation set).

    python bench/results/session27/q_temperature_probe_cpu/q_scale.py SHAREGPT_V3.json
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # bench/
from acceptance_bounds import K, held_out_answers, held_out_engine  # noqa: E402
from specwire.drafter.eagle_head import load_eagle_head, shared_target_weights  # noqa: E402
from specwire.drafter.eagle_trainer import Trainer, chain_length  # noqa: E402
from specwire.drafter.eval_filter import EvalFilter  # noqa: E402
from specwire.drafter.self_distill import record_features  # noqa: E402
from specwire.drafter.sharegpt import complete_records, is_heldout, messages  # noqa: E402
from specwire.drafter.train_eagle import DEFAULT_OUT, add_arguments  # noqa: E402
from specwire.drafter.ttt import step_mask, unroll  # noqa: E402

SCALES = [0.8, 0.9, 1.0, 1.1, 1.2, 1.35]
PROMPTS = "/tmp/tune_prompts.jsonl"


def tuning_prompts(sharegpt: str) -> None:
    lines = pathlib.Path("bench/data/heldout_chat_sharegpt.jsonl").read_text().splitlines()
    held = {json.loads(line)["prompt"] for line in lines}
    evals, out = EvalFilter.load(), []
    for i, record in enumerate(complete_records(sharegpt)):
        if i < 8000 or is_heldout(str(record.get("id", "")), 0.03) or not (m := messages(record)):
            continue
        text = m[0]["content"]
        if text not in held and 20 <= len(text) <= 600 and not evals.matches(text):
            out.append({"prompt": text, "source": "sharegpt_train_tune"})
            if len(out) == 48:
                break
    pathlib.Path(PROMPTS).write_text("\n".join(json.dumps(o) for o in out) + "\n")


@torch.no_grad()
def main() -> None:
    tuning_prompts(sys.argv[1])
    engine = held_out_engine(None, "cpu")
    head = load_eagle_head(DEFAULT_OUT, engine.config, shared_target_weights(engine.model), torch.float32,
                           engine.device, 1024)
    conversations = held_out_answers(engine, PROMPTS, 48, 64, 1.0, 0)
    train_args = argparse.ArgumentParser()
    add_arguments(train_args)
    trainer = Trainer(head, engine, train_args.parse_args(["--ttt-steps", str(K)]), cuda=False)
    sums, positions = {c: [0.0] * K for c in SCALES}, [0.0] * K
    for batch in trainer._batches(conversations, epoch=None):
        x = trainer._inputs(record_features(engine, [conversations[i] for i in batch]))
        p_in = torch.softmax(engine.model.lm_head(x["target"].to(engine.dtype)).float(), -1)[
            ..., head.draft_to_target]
        for j, out in enumerate(unroll(head, x["ids"], x["feats"], K)):
            m = step_mask(x["mask"], j)
            logits, pin = head.logits(out)[m].float(), p_in[m]
            for c in SCALES:
                top, idx = torch.softmax(logits / c, -1).topk(64, -1)
                sums[c][j] += float(torch.minimum(pin.gather(-1, idx), top / top.sum(-1, keepdim=True)).sum())
            positions[j] += float(m.sum())
    rates = {c: [round(s / max(n, 1), 4) for s, n in zip(sums[c], positions, strict=True)] for c in SCALES}
    print(json.dumps({"prompts": PROMPTS, "positions": positions, "overlap_top64": rates,
                      "proxy": {c: round(chain_length(r), 3) for c, r in rates.items()}}, indent=1))


if __name__ == "__main__":
    main()
