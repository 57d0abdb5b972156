"""ShareGPT prompts: complete records of a cut-short file, human turns with context, a stable held-out split
by conversation, published evaluation questions filtered out, and the held-out flag kept by train-eagle."""

import argparse
import json
from pathlib import Path

import pytest
from specwire.drafter.eval_filter import EvalFilter
from specwire.drafter.sharegpt import (
    build,
    complete_records,
    is_heldout,
    load_prompt_ids,
    messages,
    save_prompt_ids,
)
from specwire.drafter.train_eagle import _prompt_sources

from specwire.default_model import default_model_path
from specwire.tokenizer import load_tokenizer


def record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    record(
        "a_0",
        ("human", "Write a haiku about autumn leaves."),
        ("gpt", "Leaves fall..."),
        ("human", "Now one about snow."),
        ("gpt", "Snow..."),
    ),
    record("b_0", ("gpt", "Hello! How can I help?"), ("human", "Explain recursion simply.")),
    record(
        "c_0", ("human", "hi, How can I improve my time management skills? thanks"), ("gpt", "...")
    ),  # Vicuna-bench
    record("d_0", ("gpt", "no human turn here")),
    record("e_0", ("human", "word " * 900), ("gpt", "ok")),  # longer than the prompt budget
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def test_complete_records_stop_at_the_cut(tmp_path):
    text = json.dumps(RECORDS, indent=2)
    cut = text[: text.index('"id": "c_0"') + 20]  # the third record is cut short
    (tmp_path / "s.json").write_text(cut)
    assert [r["id"] for r in complete_records(tmp_path / "s.json")] == ["a_0", "b_0"]
    (tmp_path / "full.json").write_text(text)
    assert len(list(complete_records(tmp_path / "full.json"))) == len(RECORDS)


def test_messages_map_roles_and_start_at_the_first_human_turn():
    assert messages(RECORDS[1]) == [{"role": "user", "content": "Explain recursion simply."}]
    assert [m["role"] for m in messages(RECORDS[0])] == ["user", "assistant", "user", "assistant"]
    assert messages(RECORDS[3]) == []


def test_heldout_is_stable_per_conversation():
    assert is_heldout("xyz_0", 0.5) == is_heldout("xyz_7", 0.5)
    share = sum(is_heldout(f"id{i}_0", 0.1) for i in range(4000)) / 4000
    assert 0.08 < share < 0.12
    assert not any(is_heldout(f"id{i}", 0.0) for i in range(100))


def test_build_filters_eval_questions_and_keeps_context(tok, tmp_path):
    rows, stats = build(iter(RECORDS), tok, EvalFilter.load(), 0.0, 256, seed=0)
    assert stats == {"records": 5, "eval_matches": 1, "no_human_turn": 1, "too_long": 1}
    assert [r["source"] for r in rows] == ["sharegpt", "sharegpt_multiturn", "sharegpt"]
    multi = tok.decode(rows[1]["ids"], skip_special_tokens=False)
    assert "autumn leaves" in multi and "Leaves fall" in multi and multi.rstrip().endswith("assistant")
    assert not any(r["heldout"] for r in rows) and not any("text" in r for r in rows)
    save_prompt_ids(tmp_path / "p.npz", rows)
    assert load_prompt_ids(tmp_path / "p.npz") == [(r["source"], r["ids"], r["heldout"]) for r in rows]
    held, _ = build(iter(RECORDS[:2]), tok, EvalFilter.load(), 1.0, 256, seed=0)
    assert all(r["heldout"] for r in held) and [r.get("text") for r in held][0].startswith("Write a haiku")


def test_train_eagle_keeps_the_heldout_flag(tok, tmp_path):
    rows = [{"ids": [1, 2, i], "source": "sharegpt", "heldout": i < 2} for i in range(6)]
    save_prompt_ids(tmp_path / "p.npz", rows)
    args = argparse.Namespace(
        seed=0,
        data_dir=None,
        chat_prompts=str(tmp_path / "p.npz"),
        holdout=0.5,
        max_prompts=0,
        max_heldout=200,
    )
    held, train = _prompt_sources(args)
    assert sorted(p.ids[2] for p in held["sharegpt"]) == [0, 1]
    assert sorted(p.ids[2] for p in train["sharegpt"]) == [2, 3, 4, 5]


def test_committed_heldout_chat_set_has_no_eval_questions():
    lines = [
        json.loads(x) for x in (Path(__file__).parents[1] / "bench/data/heldout_chat_sharegpt.jsonl").open()
    ]
    assert len(lines) == 300 and all(x["source"] == "sharegpt_heldout" for x in lines)
    f = EvalFilter.load()
    assert not any(f.matches(x["prompt"]) for x in lines)
    assert f.matches(
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
        "cultural experiences and must-see attractions."
    )
