"""`specwire bench --local` on a tiny random target: end to end; greedy output equals target-only output."""

import asyncio
import json

import pytest
import torch
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from test_drafter_train import write_tiny_target

from specwire.cli import main
from specwire.commands.bench import build_engine, speculate
from specwire.sampling_params import SamplingParams
from specwire.weights import load_checkpoint

PROMPTS = [
    {"prompt": "Hello there"},
    {"instruction": "Count to five."},
    {"question": "Why is the sky blue?"},
    {"turns": ["Tell me a joke.", "Another one."]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_target(root / "target")
    config, sd = load_checkpoint(target)
    heads = {}
    for arch in ("eagle1", "eagle3"):
        head_config = EagleHeadConfig.for_target(config, arch, draft_vocab_size=4096)
        head = EagleHead(head_config, sd, torch.float32, "cpu", 256)
        head.init_weights(seed=1)
        save_eagle_head(head, root / arch, dtype=torch.float32)
        heads[arch] = root / arch
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return target, heads, prompts


@pytest.mark.parametrize("arch,temperature", [("eagle1", "0"), ("eagle3", "0.8")])
def test_bench_local_prints_acceptance_json(setup, capsys, arch, temperature):
    target, heads, prompts = setup
    rc = main(
        [
            "bench",
            "--local",
            "--prompts",
            str(prompts),
            "--k",
            "3",
            "--temperature",
            temperature,
            "--max-tokens",
            "12",
            "--head",
            str(heads[arch]),
            "--model",
            str(target),
            "--device",
            "cpu",
            "--batch",
            "2",
            "--limit",
            "2",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == 2 and out["k"] == 3
    assert 1.0 <= out["mean_acceptance_length"] <= 4.0
    assert 1.0 <= out["tokens_per_round"] <= out["mean_acceptance_length"]
    assert len(out["acceptance_per_position"]) == 3
    assert out["tokens"] <= 2 * 12 and out["draft_tokens"] >= out["accepted_tokens"]


@pytest.mark.parametrize("arch,cache_branches,min_confidence",
                         [("eagle1", 0, 0.0), ("eagle3", 4, 0.0), ("eagle1", 0, 6e-4), ("eagle3", 4, 6e-4)])
def test_greedy_speculative_output_equals_target_only(setup, arch, cache_branches, min_confidence):
    """Serial and cached drafting, with and without dynamic draft length (the random heads' top
    probabilities straddle 6e-4, so some chains stop early)."""
    target, heads, prompts = setup
    engine, tok = build_engine(str(target), str(heads[arch]), "cpu", batch=3, k=4)
    ids = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        for p in ("Hello there", "Count to five.", "Why is the sky blue?", "Name a colour.")
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 13, 1)]

    def run(confidence: float) -> dict:
        done = asyncio.run(speculate(engine, tok, str(heads[arch]), ids, params, k=4,
                                     cache_branches=cache_branches, min_confidence=confidence, draft_top_k=0))
        assert done.outputs == want
        assert engine.num_free_slots == 3
        return done.summary()

    want = [r.token_ids for r in engine.generate(ids, params)]
    stats = run(min_confidence)
    if cache_branches:  # a random head's guesses at the bonus token rarely hit: the tables were looked up
        assert stats["cache_hit_rate"] is not None
    else:
        assert stats["draft_tokens"] > 0 and stats["cache_hit_rate"] is None
    if min_confidence and not cache_branches:
        assert stats["draft_tokens"] < run(0.0)["draft_tokens"]


def test_tables_ahead_are_looked_up_in_every_round_and_keep_greedy_output(setup):
    """--queued-tables: drafts queued behind the sampler with tables ahead, asked for in every steady round
    (a measurement of how often a table holds the outcome); greedy output stays target-only."""
    target, heads, prompts = setup
    engine, tok = build_engine(str(target), str(heads["eagle3"]), "cpu", batch=2, k=4)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ("Hi", "Count.")]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2
    want = [r.token_ids for r in engine.generate(ids, params)]
    done = asyncio.run(speculate(engine, tok, str(heads["eagle3"]), ids, params, k=4, queued_tables=4))
    stats = done.summary()
    assert done.outputs == want
    assert stats["cache_lookups"]["hit"] + stats["cache_lookups"]["miss"] > 0 and stats["draft_tokens"] > 0


def test_bench_needs_local(setup, capsys):
    target, heads, prompts = setup
    assert main(["bench", "--prompts", str(prompts)]) == 2
    assert "pass --local" in capsys.readouterr().err
