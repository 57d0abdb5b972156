"""`specwire bench --local` on a tiny random target: end to end; greedy output equals target-only output."""

import json

import pytest
import torch
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from test_drafter_train import write_tiny_target

from specwire.cli import main
from specwire.commands.bench import SpecDecoder, build_local
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
    assert len(out["acceptance_per_position"]) == 3
    assert out["tokens"] <= 2 * 12 and out["draft_tokens"] >= out["accepted_tokens"]


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_greedy_speculative_output_equals_target_only(setup, arch):
    target, heads, prompts = setup
    engine, proposer = build_local(str(target), str(heads[arch]), "cpu", batch=3, k=4)
    tok = engine.tokenizer
    ids = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        for p in ("Hello there", "Count to five.", "Why is the sky blue?", "Name a colour.")
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 13, 1)]
    stats = SpecDecoder(engine, proposer, k=4, draft_top_k=0).run(ids, params)
    want = [r.token_ids for r in engine.generate(ids, params)]
    assert stats.outputs == want
    assert stats.draft_tokens > 0 and not proposer.requests and engine.num_free_slots == 3


def test_bench_needs_local(setup, capsys):
    target, heads, prompts = setup
    assert main(["bench", "--prompts", str(prompts)]) == 2
    assert "pass --local" in capsys.readouterr().err
