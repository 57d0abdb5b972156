"""Probe (session 27): is the head's q calibrated at T = 1? Picks 48 ShareGPT first turns of the training
split (records 8,000 on, not held out, eval-filtered, not in the committed held-out chat set, which is the
evaluation set) into /tmp/tune_prompts.jsonl; then bench/acceptance_bounds.py --q-scales reads them:

    python bench/results/session27/q_temperature_probe_cpu/q_scale.py SHAREGPT_V3.json
    python bench/acceptance_bounds.py --prompts /tmp/tune_prompts.jsonl --limit 48 --max-tokens 64 \\
        --temperature 1 --top-k 64 --q-scales 0.8,0.9,1.1,1.2,1.35 --out q_scale_T1_cpu.json
"""
import json
import pathlib
import sys

from specwire.drafter.eval_filter import EvalFilter
from specwire.drafter.sharegpt import complete_records, is_heldout, messages


def main(sharegpt: str, out: str = "/tmp/tune_prompts.jsonl") -> None:
    lines = pathlib.Path("bench/data/heldout_chat_sharegpt.jsonl").read_text().splitlines()
    held = {json.loads(line)["prompt"] for line in lines}
    evals, picked = EvalFilter.load(), []
    for i, record in enumerate(complete_records(sharegpt)):
        if i < 8000 or is_heldout(str(record.get("id", "")), 0.03) or not (m := messages(record)):
            continue
        text = m[0]["content"]
        if text not in held and 20 <= len(text) <= 600 and not evals.matches(text):
            picked.append({"prompt": text, "source": "sharegpt_train_tune"})
            if len(picked) == 48:
                break
    pathlib.Path(out).write_text("\n".join(json.dumps(p) for p in picked) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
