"""Self-distillation data for EAGLE heads: prompts -> the target's own responses -> the target's features.

The head must imitate the target, so the target writes the responses (greedy or sampled, as it will be run)
and its hidden states are recorded on exactly those tokens. The prompt set is widened self-instruct style:
the target writes new instructions from a few seed tasks shown as examples.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specwire.engine import TargetEngine
from specwire.sampling_params import SamplingParams

PROMPT_FILES = ("self_instruct_seed_tasks.jsonl", "gsm8k_train.jsonl", "humaneval.jsonl")


def prompt_text(record: dict) -> str | None:
    """The user prompt of one JSON record: "prompt", "instruction" (+ its first input), "question" or
    "turns"[0]."""
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for key in ("prompt", "question"):
        if isinstance(record.get(key), str):
            return record[key]
    if isinstance(record.get("instruction"), str):
        instances = record.get("instances") or [{}]
        extra = instances[0].get("input", "") if isinstance(instances[0], dict) else ""
        return record["instruction"] + (f"\n\n{extra}" if extra else "")
    return None


def read_prompts(path: str | Path) -> list[str]:
    """Prompts of a JSONL file (see prompt_text); raises ValueError naming the first bad line."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            text = prompt_text(json.loads(line))
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e})") from e
        if text is None:
            raise ValueError(f"{path}:{n}: no 'prompt', 'instruction', 'question' or 'turns' field")
        prompts.append(text)
    return prompts


def load_seed_prompts(data_dir: str | Path) -> dict[str, list[str]]:
    """{file stem: prompts} for the prompt files found in data_dir/prompts (or data_dir itself)."""
    root = Path(data_dir)
    root = root / "prompts" if (root / "prompts").is_dir() else root
    found = {f.stem: read_prompts(f) for f in (root / name for name in PROMPT_FILES) if f.is_file()}
    if not found:
        raise ValueError(f"no prompt files ({', '.join(PROMPT_FILES)}) in {str(root)!r}")
    return found


@dataclass
class Sample:
    """One distilled conversation: tokens = prompt + response, and the target's features on every token."""

    tokens: torch.Tensor  # [n] int64
    prompt_len: int
    hidden: torch.Tensor  # [n, H] final normed hidden state (EAGLE-1 features, and the target's logits)
    aux: torch.Tensor | None  # [n, 3H] EAGLE-3 taps


def chat_ids(engine: TargetEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def write_instructions(
    engine: TargetEngine, seeds: list[str], count: int, rng: random.Random, deadline: float, batch: int
) -> list[str]:
    """Self-instruct: show the target three seed tasks and let it write a new one (sampled, T = 1)."""
    short = [s for s in seeds if len(s) < 400]
    made: list[str] = []
    if len(short) < 3:
        return made
    bar = tqdm(total=count, desc="self-instruct", unit="task")
    rounds = 3 * -(-count // batch)  # a weak target may rarely finish a task: bounded retries
    for _ in range(rounds):
        if len(made) >= count or time.monotonic() > deadline:
            break
        asks = []
        for _ in range(min(batch, count - len(made))):
            shown = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(rng.sample(short, 3)))
            asks.append(
                f"Here are some example tasks:\n{shown}\n\nWrite one new task that is different from "
                "these. Reply with the task only."
            )
        params = SamplingParams(temperature=1.0, max_tokens=80, seed=rng.randrange(2**62))
        results = engine.generate([chat_ids(engine, a) for a in asks], [params] * len(asks))
        for r in results:
            text = r.text.strip().split("\n\n")[0].strip().removeprefix("4. ").strip()
            if r.finish_reason == "stop" and len(text) >= 10 and text not in made:
                made.append(text)
                bar.update(1)
    bar.close()
    return made


def distill(
    engine: TargetEngine,
    prompts: list[str],
    max_new_tokens: int,
    sample_fraction: float,
    rng: random.Random,
    deadline: float,
    batch: int,
    desc: str,
) -> list[Sample]:
    """Let the target answer the prompts (a sample_fraction of them at T = 0.7, the rest greedy), then
    record its features on prompt + response. Stops at the deadline with what it has."""
    samples: list[Sample] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for start in range(0, len(prompts), batch):
        if time.monotonic() > deadline:
            break
        ids = [
            chat_ids(engine, p)[: engine.max_context - max_new_tokens] for p in prompts[start : start + batch]
        ]
        params = [
            SamplingParams(
                temperature=0.7 if rng.random() < sample_fraction else 0.0,
                max_tokens=max_new_tokens,
                seed=rng.randrange(2**62),
            )
            for _ in ids
        ]
        results = engine.generate(ids, params)
        samples += record_features(engine, [(p, r.token_ids) for p, r in zip(ids, results, strict=True)])
        bar.update(len(ids))
    bar.close()
    return samples


@torch.no_grad()
def record_features(engine: TargetEngine, conversations: list[tuple[list[int], list[int]]]) -> list[Sample]:
    """Prefill prompt + response through the target; keep hidden (and aux taps) on the engine's device."""
    samples = []
    for start in range(0, len(conversations), engine.max_slots):
        chunk = conversations[start : start + engine.max_slots]
        seqs = [(p + r)[: engine.max_context] for p, r in chunk]
        slots = [engine.allocate_slot() for _ in seqs]
        try:
            out = engine.prefill(list(zip(slots, seqs, strict=True)))
        finally:
            for s in slots:
                engine.free_slot(s)
        offset = 0
        for (prompt, _), seq in zip(chunk, seqs, strict=True):
            n = len(seq)
            aux = out.aux_hidden[offset : offset + n] if out.aux_hidden is not None else None
            samples.append(Sample(torch.tensor(seq), len(prompt), out.hidden[offset : offset + n], aux))
            offset += n
    return samples
