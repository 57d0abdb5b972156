"""Self-distillation data for EAGLE heads: prompts -> the target's own responses (token ids) -> its features.

The head must imitate the target, so the target writes the responses (greedy or sampled, as it will be run)
and its hidden states are recorded on exactly those tokens. The prompt set is widened self-instruct style:
the target writes new instructions from a few seed tasks shown as examples (degenerate and near-duplicate ones
dropped). Every prompt keeps its source, so the mix can be capped per source and held out per source.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
from tqdm import tqdm

from specwire.engine import TargetEngine
from specwire.sampling_params import SamplingParams

PROMPT_FILES = ("self_instruct_seed_tasks.jsonl", "gsm8k_train.jsonl", "humaneval.jsonl")
GENERATED_SOURCE = "self_instruct_generated"  # the instructions the target writes itself
MIN_HELDOUT_PER_SOURCE = 16  # enough held-out prompts for a per-source acceptance that is not noise
MIN_INSTRUCTION_WORDS = 3
ECHOES = ("new task", "different from these", "example tasks")  # the request's words, not a task
_LIST_MARKER = re.compile(r"^\s*(?:\d+[.)]|(?:new )?task:)\s*", re.IGNORECASE)


class Prompt(NamedTuple):
    source: str  # a prompt file's stem, GENERATED_SOURCE or a ShareGPT source
    text: str
    ids: tuple[int, ...] = ()  # chat-template token ids, when given instead of text (ShareGPT turns)


class Conversation(NamedTuple):
    """One distilled conversation as token ids: the prompt, then the target's own response."""

    tokens: list[int]
    prompt_len: int
    source: str
    temperature: float = 0.0  # the response's sampling temperature (0: greedy; NaN: not recorded)


T = TypeVar("T")


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


def tag(by_source: dict[str, list[str]]) -> dict[str, list[Prompt]]:
    """Texts as Prompts of their source."""
    return {name: [Prompt(name, text) for text in texts] for name, texts in by_source.items()}


def interleave(by_source: dict[str, list[Prompt]], rng: random.Random) -> list[Prompt]:
    """All prompts in one list, shuffled, so a deadline cut-off keeps the mix."""
    tagged = [p for prompts in by_source.values() for p in prompts]
    rng.shuffle(tagged)
    return tagged


def split_per_source(
    by_source: dict[str, list[T]], holdout: float
) -> tuple[dict[str, list[T]], dict[str, list[T]]]:
    """(held-out, train), stratified: each source holds out its first `holdout` share (shuffle first), but
    at least min(MIN_HELDOUT_PER_SOURCE, n // 4), so every source of 4+ prompts is measured, and never all."""
    held, train = {}, {}
    for name, texts in by_source.items():
        n = len(texts)
        k = min(max(round(n * holdout), min(MIN_HELDOUT_PER_SOURCE, n // 4)), max(n - 1, 0))
        held[name], train[name] = texts[:k], texts[k:]
    return held, train


def cap_source_shares(by_source: dict[str, list[T]], max_share: float) -> dict[str, list[T]]:
    """Truncate the largest sources to a common size C, the largest C with C <= max_share x the capped total,
    so no source exceeds max_share of the mix. k sources cannot all stay below 1/k: then the cap is 1/k."""
    sizes = [len(texts) for texts in by_source.values() if texts]
    share = max(max_share, 1 / max(len(sizes), 1))

    def fits(c: int) -> bool:
        return c <= share * sum(min(n, c) for n in sizes) + 1e-9

    lo, hi = 0, max(sizes, default=0)
    while lo < hi:  # share x total - c is concave in c and 0 at c = 0: fits() holds on 0..C, then fails
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return {name: texts[:lo] for name, texts in by_source.items()}


def normalise(text: str) -> str:
    """Lower-case words without list markers or punctuation: near-identical instructions compare equal."""
    return " ".join(re.findall(r"\w+", _LIST_MARKER.sub("", text).lower()))


def screen_instruction(text: str, seen: set[str]) -> str:
    """'degenerate' (under MIN_INSTRUCTION_WORDS words, looping: a word thrice in a row or under half the
    words distinct, or echoing the request), 'duplicate' (normalised text in seen) or 'kept' (then added to
    seen)."""
    words = normalise(text).split()
    key = " ".join(words)
    runs = zip(words, words[1:], words[2:], strict=False)
    looping = len(set(words)) < 0.5 * len(words) or any(a == b == c for a, b, c in runs)
    if len(words) < MIN_INSTRUCTION_WORDS or looping or any(e in key for e in ECHOES):
        return "degenerate"
    if key in seen:
        return "duplicate"
    seen.add(key)
    return "kept"


@dataclass
class Sample:
    """One distilled conversation: tokens = prompt + response, and the target's features on every token."""

    tokens: torch.Tensor  # [n] int64
    prompt_len: int
    hidden: torch.Tensor  # [n, H] final normed hidden state (EAGLE-1 features, and the target's logits)
    aux: torch.Tensor | None  # [n, 3H] EAGLE-3 taps
    source: str = ""
    temperature: float = 0.0  # the response's (0: greedy)


def chat_ids(engine: TargetEngine, prompt: Prompt | str) -> list[int]:
    """A prompt's token ids: given ids, or the text as one user message in the chat template."""
    if isinstance(prompt, Prompt) and prompt.ids:
        return list(prompt.ids)
    tok = engine.tokenizer
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def write_instructions(
    engine: TargetEngine,
    seeds: list[str],
    count: int,
    rng: random.Random,
    deadline: float,
    batch: int,
    known: list[str],
) -> tuple[list[str], Counter]:
    """Self-instruct: show the target three seed tasks and let it write a new one (sampled, T = 1). Keeps only
    finished, non-degenerate instructions unlike each other and the `known` prompts (see screen_instruction);
    returns them and the count of each verdict."""
    short = [s for s in seeds if len(s) < 400]
    made: list[str] = []
    verdicts: Counter = Counter()
    if len(short) < 3:
        return made, verdicts
    seen = {normalise(k) for k in known}
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
            text = _LIST_MARKER.sub("", r.text.strip().split("\n\n")[0]).strip()
            verdict = screen_instruction(text, seen) if r.finish_reason == "stop" else "unfinished"
            verdicts[verdict] += 1
            if verdict == "kept" and len(made) < count:
                made.append(text)
                bar.update(1)
    bar.close()
    return made, verdicts


def distill(
    engine: TargetEngine,
    prompts: list[Prompt],
    max_new_tokens: int,
    sample_fraction: float,
    sample_temperature: float,
    rng: random.Random,
    deadline: float,
    batch: int,
    desc: str,
) -> list[Conversation]:
    """Let the target answer the prompts (a sample_fraction of them at sample_temperature, the rest
    greedy). Stops at the deadline with what it has; features are recorded later (record_features)."""
    out: list[Conversation] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for start in range(0, len(prompts), batch):
        if time.monotonic() > deadline:
            break
        chunk = prompts[start : start + batch]
        ids = [chat_ids(engine, p)[: engine.max_context - max_new_tokens] for p in chunk]
        params = [
            SamplingParams(
                temperature=sample_temperature if rng.random() < sample_fraction else 0.0,
                max_tokens=max_new_tokens,
                seed=rng.randrange(2**62),
            )
            for _ in ids
        ]
        results = engine.generate(ids, params)
        for i, r, p, sp in zip(ids, results, chunk, params, strict=True):
            out.append(Conversation(i + r.token_ids, len(i), p.source, sp.temperature))
        bar.update(len(ids))
    bar.close()
    return out


@torch.no_grad()
def record_features(engine: TargetEngine, conversations: list[Conversation]) -> list[Sample]:
    """Prefill each conversation through the target; keep hidden (and aux taps) on the engine's device."""
    samples = []
    for start in range(0, len(conversations), engine.max_slots):
        chunk = conversations[start : start + engine.max_slots]
        seqs = [c.tokens[: engine.max_context] for c in chunk]
        slots = [engine.allocate_slot() for _ in seqs]
        try:
            out = engine.prefill(list(zip(slots, seqs, strict=True)))
        finally:
            for s in slots:
                engine.free_slot(s)
        offset = 0
        for c, seq in zip(chunk, seqs, strict=True):
            n = len(seq)
            aux = out.aux_hidden[offset : offset + n] if out.aux_hidden is not None else None
            hidden = out.hidden[offset : offset + n]
            samples.append(Sample(torch.tensor(seq), c.prompt_len, hidden, aux, c.source, c.temperature))
            offset += n
    return samples
