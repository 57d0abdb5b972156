"""The chain replayed over a text (drafter_service.chain_visits, the trainer's chain_length_k4) is what the
real drafter accepts on it: the scheduler with a co-located drafter (`specwire bench --local`) on the
target's greedy answers, against the trainer's evaluation of the same answers."""

import argparse
import asyncio

import pytest
import torch
from specwire.drafter import eagle_trainer
from specwire.drafter.eagle_head import load_eagle_head, save_eagle_head
from specwire.drafter.eagle_trainer import Trainer
from specwire.drafter.self_distill import Conversation
from specwire.drafter.train_eagle import add_arguments
from test_services_e2e import MAX_CONTEXT, bigram_head, prompts, tiny_target

from specwire.commands.bench import speculate
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import load_tokenizer

K = 4


def test_replayed_chain_equals_the_drafters_acceptance(tmp_path, monkeypatch):
    config, sd = tiny_target()  # the next token mostly follows from the current one: the head often hits
    for name in sd:  # and more often with the context's nudges damped: rounds of every length
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = sd[name] * 0.25
    save_eagle_head(bigram_head(config, sd), tmp_path / "head", dtype=torch.float32)
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=8,
                          max_context=MAX_CONTEXT)
    tokenizer = load_tokenizer(default_model_path())
    asked = prompts(8, seed=31)

    def live_run(max_tokens: int):
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(asked)
        return asyncio.run(speculate(engine, tokenizer, str(tmp_path / "head"), asked, params, k=K,
                                     cuda_graphs=False))

    live = live_run(64)
    measured = live.summary()
    assert measured["drafts"] > 0 and 1.5 < measured["mean_acceptance_length"] < K + 1  # hits and misses

    answers = [Conversation(p + out, len(p), "held-out", 0.0)
               for p, out in zip(asked, live.outputs, strict=True)]
    head = load_eagle_head(tmp_path / "head", config, sd, torch.float32, "cpu", MAX_CONTEXT)
    train_args = argparse.ArgumentParser()
    add_arguments(train_args)
    trainer = Trainer(head, engine, train_args.parse_args(["--ttt-steps", str(K)]), cuda=False)
    replay = trainer.evaluate(answers)["per_answer"]["greedy"]
    # The replay counts whole rounds only; the live run's last round of each answer is cut to the room left.
    # (measured 2026-11-27: 2.383 against 2.377, every position within 0.01)
    assert replay["chain_length_k4"] == pytest.approx(measured["mean_acceptance_length"], abs=0.03)
    rates = zip(replay["chain_per_position"], measured["acceptance_per_position"], strict=True)
    for rate, live_rate in rates:
        assert rate == pytest.approx(live_rate, abs=0.02)
    # Over each answer's first tokens only (the trainer's FIRST_TOKENS, the bench's length): what the drafter
    # accepts on answers cut there, which greedy answers of that length are (measured 2026-11-27: 2.408
    # against 2.408; the whole 64-token answers' replay 2.383).
    monkeypatch.setattr(eagle_trainer, "FIRST_TOKENS", 32)
    first = trainer.evaluate(answers)["per_answer"]["greedy"]
    short = live_run(32).summary()
    assert first["chain_length_k4_first32"] == pytest.approx(short["mean_acceptance_length"], abs=0.03)
    assert first["chain_length_k4"] == replay["chain_length_k4"]  # the whole answers' replay is unchanged
