"""train-eagle on a tiny random target (CPU): runs end to end within its budget and writes a loadable head
from a capped, stratified prompt mix. The mix helpers (cap, stratified split, instruction screening) alone."""

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from specwire.drafter.eagle_head import load_eagle_head
from specwire.drafter.eagle_trainer import answer_kind, forward_kl, overlap
from specwire.drafter.self_distill import (
    Conversation,
    cap_source_shares,
    normalise,
    prompt_text,
    screen_instruction,
    split_per_source,
)
from specwire.drafter.token_store import save_token_lists
from specwire.drafter.train_eagle import DATA_FILE, load_data, save_data

from specwire.cli import main
from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.tokenizer import load_tokenizer
from specwire.weights import checkpoint_shapes, load_checkpoint

SEED_TASKS = [
    {"instruction": "Name three fruits.", "instances": [{"input": ""}]},
    {"instruction": "Translate to French.", "instances": [{"input": "Good morning"}]},
    {"instruction": "Write a haiku about rain.", "instances": [{"input": ""}]},
    {"instruction": "List two prime numbers.", "instances": [{"input": ""}]},
    {"instruction": "Describe a cat in one sentence.", "instances": [{"input": ""}]},
    {"instruction": "Give an antonym of the word.", "instances": [{"input": "cold"}]},
    {"instruction": "Suggest a name for a bakery.", "instances": [{"input": ""}]},
    {
        "instruction": "Summarise the sentence.",
        "instances": [{"input": "The sun rose over the quiet hills."}],
    },
]
SOURCES = {  # file stem -> records; GSM8K outnumbers the rest, as in the real data
    "self_instruct_seed_tasks": SEED_TASKS,
    "gsm8k_train": [{"question": f"What is {a} + {a + 3}?"} for a in range(12)],
    "humaneval": [{"prompt": f"def f{i}(x):\n    return x"} for i in range(4)],
}
MAX_SHARE = 0.4


def write_tiny_target(path: Path, num_layers: int = 6, seed: int = 0) -> Path:
    """A random small Llama with SmolLM2's tokenizer and chat template, as a Hugging Face directory."""
    path.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(default_model_path())
    hf = {
        "model_type": "llama",
        "vocab_size": tok.vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": list(tok.eos_token_ids),
        "bos_token_id": tok.bos_token_id,
    }
    config = ModelConfig.from_hf_dict(hf)
    g = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    save_file({n: torch.randn(s, generator=g) * 0.5 for n, s in shapes.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(hf))
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({**tok.special_tokens, "chat_template": tok.chat_template})
    )
    return path


def train_cli(tiny_target: Path, data_dir: Path, out: Path, *extra: str) -> int:
    """`specwire train-eagle` on the tiny target and prompt files, on the CPU."""
    common = ["--model", str(tiny_target), "--data-dir", str(data_dir), "--out", str(out), "--device", "cpu"]
    return main(["train-eagle", *common, *extra])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "prompts").mkdir()
    for stem, records in SOURCES.items():
        (root / "prompts" / f"{stem}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return root


@pytest.mark.parametrize(
    ("arch", "loss"),
    [
        ("eagle1", []),
        ("eagle3", ["--tv-weight", "0.5", "--answers-per-prompt", "2"]),
    ],
)
def test_train_eagle_smoke_writes_a_loadable_head(tiny_target, data_dir, tmp_path, capsys, arch, loss):
    out = tmp_path / "head"
    rc = train_cli(
        tiny_target, data_dir, out,
        "--arch", arch, *loss,
        "--log-every", "1",
        "--max-minutes", "3",  # generous (a loaded 2-core CI machine): the 2 epochs end it early
        "--gen-fraction", "0.7",
        "--max-new-tokens", "12",
        "--self-instruct", "2",
        "--gen-batch", "4",
        "--holdout", "0.2",
        "--epochs", "2",
        "--draft-vocab", "512",
        "--max-source-share", str(MAX_SHARE),
        "--write-heldout", str(tmp_path / "heldout.jsonl"),
    )  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] > 0
    log = json.loads((out / "train_log.json").read_text())
    counts = log["data"]["sources"]
    assert set(SOURCES) <= set(counts)
    for stem, records in SOURCES.items():  # stratified: every source of 4+ prompts is held out on its own
        assert counts[stem]["available"] == len(records) >= 4
        assert counts[stem]["held_out_prompts"] >= 1 and counts[stem]["held_out_conversations"] >= 1
    for kind in ("train_prompts", "held_out_prompts"):  # the cap: no source above MAX_SHARE of the mix
        total = sum(c[kind] for c in counts.values())
        assert all(c[kind] <= MAX_SHARE * total for c in counts.values()), (kind, counts)
    gsm8k = counts["gsm8k_train"]
    assert gsm8k["train_prompts"] + gsm8k["held_out_prompts"] < gsm8k["available"]  # the cap did bind
    assert log["data"]["train_conversations"] == sum(c["train_conversations"] for c in counts.values())
    answers = log["data"]["answers"]
    per_prompt = 2 if arch == "eagle3" else 1
    assert answers["per_prompt"] == per_prompt
    # every training prompt answered per_prompt times (the generous budget cuts none), the extra answers
    # sampled: at most one greedy answer per prompt
    train_prompts = sum(c["train_prompts"] for c in counts.values())
    assert log["data"]["train_conversations"] == per_prompt * train_prompts
    assert answers["greedy_share"] * log["data"]["train_conversations"] <= train_prompts + 1e-6
    assert answers["greedy_share"] + answers["sampled_share"] == pytest.approx(1.0)
    last = log["held_out"][-1]
    assert 0.0 <= last["top1_1"] <= 1.0 and 0.0 <= last["overlap_1"] <= 1.0
    assert ("overlap_1" in log["curve"][-1]) == bool(loss)  # training steps compute it only for the loss
    per_source = last["per_source"]
    assert set(per_source) == {name for name, c in counts.items() if c["held_out_conversations"]}
    assert all(0.0 <= m["top1_1"] <= 1.0 for m in per_source.values())
    assert sum(m["positions"] for m in per_source.values()) == last["positions"] > 0
    # Greedy and sampled responses apart (the default samples half), each with both proxies; the T = 1 one
    # counts p's mass off the draft vocabulary as lost, so it never exceeds the renormalised overlap.
    per_answer = last["per_answer"]
    assert set(per_answer) <= {"greedy", "sampled"} and per_answer
    assert sum(m["positions"] for m in per_answer.values()) == last["positions"]
    for m in (last, *per_answer.values()):
        assert 1.0 <= m["acceptance_length_proxy_k4_t1"] <= 5.0
        # the chain replayed on the text: per-position rates fall, and sum to the length less one
        rates = m["chain_per_position"]
        assert len(rates) == 4 and all(1.0 >= a >= b >= 0.0 for a, b in itertools.pairwise(rates))
        assert m["chain_length_k4"] == pytest.approx(1 + sum(rates), abs=2e-3)
        assert 1.0 <= m["chain_length_k4_first128"] <= 5.0  # the same over each answer's first 128 tokens
        for j in range(1, 5):
            assert 0.0 <= m[f"accept_t1_{j}"] <= m[f"overlap_{j}"] + 1e-6
        if arch == "eagle3":
            assert 0.0 < m["inside_mass"] <= 1.0 + 1e-6
        else:  # a full-vocabulary head loses no mass
            assert "inside_mass" not in m and all(m[f"accept_t1_{j}"] == m[f"overlap_{j}"] for j in (1, 2))
    lines = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert Counter(line["source"] for line in lines) == {
        name: c["held_out_prompts"] for name, c in counts.items() if c["held_out_prompts"]
    }
    for line in lines:
        if line["source"] in SOURCES:
            assert line["prompt"] in map(prompt_text, SOURCES[line["source"]])
    config, sd = load_checkpoint(tiny_target)
    head = load_eagle_head(out, config, sd)
    assert head.config.arch == arch
    assert head.config.aux_layers == ((2, 3, 3) if arch == "eagle3" else ())
    saved = json.loads((out / "config.json").read_text())
    assert saved["specwire"]["arch"] == arch and saved["torch_dtype"] == "bfloat16"


def test_train_eagle_rejects_bad_budget(tiny_target, data_dir, tmp_path, capsys):
    rc = train_cli(tiny_target, data_dir, tmp_path, "--max-minutes", "0")
    assert rc == 2 and "--max-minutes must be > 0" in capsys.readouterr().err


def test_distilled_data_keeps_each_answers_temperature(tmp_path):
    """save_data / load_data carry each answer's temperature, so a resumed run splits its held-out answers as
    the first did; data saved before the column existed loads as "unrecorded", never as greedy."""
    train = [Conversation([1, 2, 3, 4], 2, "a", 0.0), Conversation([5, 6, 7], 1, "b", 1.0)]
    held = [Conversation([8, 9, 10], 1, "a", 0.7)]
    save_data(tmp_path, train, held, {"n": 3})
    assert load_data(tmp_path) == (train, held, {"n": 3})
    assert [answer_kind(c.temperature) for c in train + held] == ["greedy", "sampled", "sampled"]
    rows = train + held
    save_token_lists(tmp_path / DATA_FILE, [c.tokens for c in rows],
                     prompt_len=np.asarray([c.prompt_len for c in rows], dtype=np.int32),
                     source=np.asarray([c.source for c in rows]),
                     held_out=np.asarray([False, False, True]))  # the columns before session 21
    old_train, old_held, _ = load_data(tmp_path)
    assert [c.tokens for c in old_train + old_held] == [c.tokens for c in rows]
    assert all(math.isnan(c.temperature) and answer_kind(c.temperature) == "unrecorded"
               for c in old_train + old_held)


def test_overlap_is_one_minus_the_total_variation_distance():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=g, dtype=torch.float64)
    p = torch.softmax(2 * torch.randn(4, 9, generator=g, dtype=torch.float64), -1)
    tv = 0.5 * (p - torch.softmax(logits, -1)).abs().sum(-1)
    torch.testing.assert_close(overlap(p, logits), 1 - tv)
    torch.testing.assert_close(overlap(p, p.log()), torch.ones(4, dtype=torch.float64))


def test_forward_kl_is_the_kl_divergence_and_its_gradient_is_q_minus_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 17, generator=g, dtype=torch.float64, requires_grad=True)
    target_logp = torch.log_softmax(3 * torch.randn(5, 17, generator=g, dtype=torch.float64), -1)
    p = target_logp.exp()
    kl = forward_kl(p, (p * target_logp).sum(-1), logits)
    reference = F.kl_div(torch.log_softmax(logits, -1), target_logp, log_target=True, reduction="none")
    torch.testing.assert_close(kl, reference.sum(-1))
    kl.sum().backward()
    torch.testing.assert_close(logits.grad, torch.softmax(logits.detach(), -1) - p)


def test_cap_source_shares_keeps_the_largest_mix_under_the_share():
    by_source = {
        "big": list(range(100)),
        "mid": list(range(30)),
        "small": list(range(20)),
        "tiny": list(range(10)),
    }
    capped = cap_source_shares(by_source, 0.3)
    sizes = {name: len(texts) for name, texts in capped.items()}
    total = sum(sizes.values())
    assert max(sizes.values()) <= 0.3 * total
    assert sizes["small"] == 20 and sizes["tiny"] == 10  # sources under the cap stay whole
    assert sizes["big"] == sizes["mid"] == 22  # 22 / 74 fits, 23 / 76 would not
    assert all(capped[name] == texts[: sizes[name]] for name, texts in by_source.items())


def test_cap_source_shares_edge_cases():
    # Two sources cannot both stay under 0.3: the best is an even split.
    assert cap_source_shares({"a": list("abcdefghij"), "b": list("xyz")}, 0.3) == {
        "a": list("abc"),
        "b": list("xyz"),
    }
    assert cap_source_shares({"a": list("abcdefghij"), "b": []}, 0.3) == {"a": list("abcdefghij"), "b": []}


@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.floats(0.05, 1.0))
def test_cap_source_shares_properties(sizes, share):
    by_source = {f"s{i}": list(range(n)) for i, n in enumerate(sizes)}
    capped = {name: len(texts) for name, texts in cap_source_shares(by_source, share).items()}
    k = sum(n > 0 for n in sizes)
    limit = max(share, 1 / max(k, 1))
    total = sum(capped.values())
    assert max(capped.values()) <= limit * total + 1e-6
    cap = max(capped.values())
    cut = [name for name, n in capped.items() if n < len(by_source[name])]
    assert all(capped[name] == cap for name in cut)  # only the largest are cut, to one common size
    if cut:  # and that size is the largest that fits: one more each would break the share
        assert cap + 1 > limit * sum(min(len(texts), cap + 1) for texts in by_source.values())


def test_split_per_source_is_stratified_and_disjoint():
    by_source = {"big": [f"b{i}" for i in range(1000)], "mid": [f"m{i}" for i in range(40)]}
    by_source |= {"small": ["s0", "s1", "s2", "s3"], "single": ["only"], "empty": []}
    held, train = split_per_source(by_source, 0.03)
    for name, texts in by_source.items():
        assert held[name] + train[name] == texts  # a split of the shuffled list, nothing lost or shared
        if len(texts) >= 4:
            assert held[name] and train[name]
    assert len(held["big"]) == 30  # the holdout share
    assert len(held["mid"]) == 10  # the per-source floor, min(16, 40 // 4), lifts 0.03 x 40
    assert held["single"] == [] and train["single"] == ["only"]


def test_screen_instruction_drops_degenerate_and_near_duplicates():
    seen = {normalise("Name three fruits.")}
    verdicts = [
        screen_instruction(text, seen)
        for text in [
            "Write a poem about the sea.",
            "write a poem about the SEA!",  # case and punctuation
            "4. Write a poem   about the sea",  # list marker and spacing
            "Name three fruits",  # a seed task copied back
            "",
            "Hello there",
            "Write write write a story about a dog.",
            "a poem a poem a poem a poem a poem",
            "Write one new task that is different from these.",  # the request echoed
            "Explain why the sky is blue to a child.",
        ]
    ]
    assert verdicts == [
        "kept",
        "duplicate",
        "duplicate",
        "duplicate",
        "degenerate",
        "degenerate",
        "degenerate",
        "degenerate",
        "degenerate",
        "kept",
    ]
    assert normalise("Explain why the sky is blue to a child.") in seen


def _train(tiny_target, data_dir, out: Path, *extra: str) -> int:
    return train_cli(
        tiny_target, data_dir, out,
        "--max-minutes", "10", "--self-instruct", "0", "--max-new-tokens", "8", "--gen-batch", "4",
        "--holdout", "0.2", "--draft-vocab", "256", "--total-steps", "7", "--ttt-steps", "3",
        "--log-every", "1", "--checkpoint-every", "2", "--batch-tokens", "160", *extra,
    )  # fmt: skip


def test_resume_from_checkpoint_equals_an_uninterrupted_run(tiny_target, data_dir, tmp_path, capsys):
    assert _train(tiny_target, data_dir, tmp_path / "a", "--checkpoint", str(tmp_path / "ck_a")) == 0
    # The same run stopped after 3 steps (mid-epoch), then resumed from its checkpoint to the end.
    ck = str(tmp_path / "ck_b")
    assert _train(tiny_target, data_dir, tmp_path / "b0", "--checkpoint", ck, "--stop-after-steps", "3") == 0
    assert json.loads((tmp_path / "b0" / "train_log.json").read_text())["steps"] == 3
    assert _train(tiny_target, data_dir, tmp_path / "b", "--checkpoint", ck, "--resume") == 0
    log_a, log_b = (json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("a", "b"))
    assert log_a["steps"] == log_b["steps"] == 7
    assert log_a["curve"] == log_b["curve"] and len(log_a["curve"]) == 7  # same losses at every step
    # the held-out answers' temperatures come back from the checkpoint too: the same per-answer split
    assert log_a["held_out"][-1] == log_b["held_out"][-1] and log_b["held_out"][-1]["per_answer"]
    assert [s["to_step"] for s in log_b["sessions"]] == [3, 7]
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert log_b["draft_vocab"]["size"] == 256 and 0 < log_b["draft_vocab"]["train_response_coverage"] <= 1
    # Every checkpoint also leaves the head so far beside it (a run whose machine is lost still has a head):
    # the last one is the finished head, and its config says at which step it was written.
    so_far = tmp_path / "ck_a" / "state-head"
    saved = load_file(so_far / "model.safetensors")
    assert saved.keys() == a.keys() and all(torch.equal(saved[k], a[k]) for k in a)
    assert json.loads((so_far / "config.json").read_text())["specwire"]["step"] == 7
    # A warm start from that head: its vocabulary and weights, moved on.
    assert (
        _train(
            tiny_target,
            data_dir,
            tmp_path / "d",
            "--init-head",
            str(so_far),
            "--stop-after-steps",
            "1",
        )
        == 0
    )
    d = load_file(tmp_path / "d" / "model.safetensors")
    assert torch.equal(d["d2t"], a["d2t"]) and not torch.equal(d["fc.weight"], a["fc.weight"])
    step = (d["fc.weight"].float() - a["fc.weight"].float()).abs().max()
    assert step < 0.1 * a["fc.weight"].float().abs().max()
    # A warm start that widens the head's MLP (64 -> 96): the new width in its config and tensors.
    assert _train(tiny_target, data_dir, tmp_path / "w", "--init-head", str(so_far),
                  "--head-intermediate-size", "96", "--stop-after-steps", "1") == 0
    assert json.loads((tmp_path / "w" / "config.json").read_text())["intermediate_size"] == 96
    w = load_file(tmp_path / "w" / "model.safetensors")
    assert w["midlayer.mlp.down_proj.weight"].shape == (a["midlayer.mlp.down_proj.weight"].shape[0], 96)
    # A warm start that doubles the head's attention heads, key/value heads with them.
    config = json.loads((so_far / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert _train(tiny_target, data_dir, tmp_path / "h", "--init-head", str(so_far),
                  "--head-attention-heads", str(2 * heads), "--stop-after-steps", "1") == 0
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2 * heads, 2 * kv_heads)
    o_proj = "midlayer.self_attn.o_proj.weight"
    assert load_file(tmp_path / "h" / "model.safetensors")[o_proj].shape[1] == 2 * a[o_proj].shape[1]
    # A warm start that grows the draft vocabulary (256 -> 300): the old ids kept, the log says the size.
    assert _train(tiny_target, data_dir, tmp_path / "v", "--init-head", str(so_far),
                  "--draft-vocab", "300", "--stop-after-steps", "1") == 0
    v = load_file(tmp_path / "v" / "model.safetensors")
    grown_ids, old_ids = (set((torch.arange(len(x["d2t"])) + x["d2t"]).tolist()) for x in (v, a))
    assert v["lm_head.weight"].shape[0] == len(grown_ids) == 300 and old_ids < grown_ids
    assert json.loads((tmp_path / "v" / "train_log.json").read_text())["draft_vocab"]["size"] == 300
    # Proof that the comparison can fail: a run with one step less ends elsewhere.
    assert _train(tiny_target, data_dir, tmp_path / "c", "--total-steps", "6") == 0
    c = load_file(tmp_path / "c" / "model.safetensors")
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
