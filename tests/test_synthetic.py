"""Synthetic models (`--model synthetic:NAME`) and forced acceptance (`--forced-acceptance-length`): the
benchmark mode that runs both services at a real model's shapes with a chosen mean acceptance length."""

import json
import math
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from specwire.kernels.rejection_sampler import rejection_sample

from specwire.cli import main
from specwire.commands.demo import Totals, start, stop, stream, wait_drafter_connected, wait_serving
from specwire.errors import ModelLoadError
from specwire.forced_acceptance import forced_rate, forced_rates, mean_acceptance_length, rates_tensor
from specwire.model_source import load_model
from specwire.synthetic import (
    EOS_ID,
    SHAPES,
    synthetic_config,
    synthetic_shape,
    synthetic_tokenizer,
    synthetic_weights,
)

CPU = torch.device("cpu")


def test_synthetic_names_are_recognised_and_unknown_ones_refused():
    assert synthetic_shape("synthetic:llama-3.1-8b") == "llama-3.1-8b"
    assert synthetic_shape(None) is None
    assert synthetic_shape("/models/llama") is None
    with pytest.raises(ModelLoadError, match="unknown synthetic model 'llama-9b'"):
        synthetic_shape("synthetic:llama-9b")


def test_the_8b_shape_is_llama_3_1_8b():
    c = synthetic_config("llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        32, 4096, 32, 8, 14336, 128256)
    assert c.rope_scaling["rope_type"] == "llama3" and not c.tie_word_embeddings


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_synthetic_tokenizer_has_the_vocabulary_and_a_stable_fingerprint(name):
    config = synthetic_config(name)
    tok = synthetic_tokenizer(config)
    assert tok.vocab_size == config.vocab_size
    assert tok.fingerprint == synthetic_tokenizer(config).fingerprint  # what the handshake compares
    text = "Héllo, wörld?\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    ids = tok.encode(prompt)
    assert max(ids) < config.vocab_size and tok.decode(ids) == text
    assert tok.decode([config.vocab_size - 1]) == f"<t{config.vocab_size - 1}>"
    assert config.eos_token_ids == (EOS_ID,) == tok.eos_token_ids


def test_synthetic_tokenizers_of_other_vocabularies_differ():
    fingerprints = {synthetic_tokenizer(synthetic_config(n)).fingerprint for n in SHAPES}
    assert len(fingerprints) == len(SHAPES)


def test_a_drafter_builds_the_same_shared_tensors_as_the_verifier():
    config, full, _, name = load_model("synthetic:tiny", CPU, torch.float32)
    _, shared, _, _ = load_model("synthetic:tiny", CPU, torch.float32, names=["lm_head.weight"])
    assert name == "synthetic:tiny" and list(shared) == ["lm_head.weight"]
    assert torch.equal(shared["lm_head.weight"], full["lm_head.weight"])
    assert not torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])  # one stream per name
    assert full["model.norm.weight"].eq(1).all() and abs(float(full["lm_head.weight"].std()) - 0.02) < 2e-3


@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("length", [1.0, 1.5, 2.0, 3.0, 4.0, 7.0])
def test_forced_rate_gives_the_requested_mean_acceptance_length(k, length):
    if length > k + 1:
        with pytest.raises(ValueError, match=r"\[1, k \+ 1\]"):
            forced_rate(length, k)
        return
    rate = forced_rate(length, k)
    assert 0 <= rate <= 1 and math.isclose(mean_acceptance_length(rate, k), length, abs_tol=1e-9)
    assert forced_rates(length, k) == (rate,) * k


def test_forced_rate_needs_drafts():
    with pytest.raises(ValueError, match="k >= 1"):
        forced_rate(1.5, 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_with_forced_rates_yields_the_requested_length(temperature):
    """4,000 rounds of k = 4 random drafts at length 3: the mean is 3 within 5 standard errors."""
    B, k, V, length = 4000, 4, 64, 3.0
    g = torch.Generator().manual_seed(0)
    num_drafts = torch.full((B,), k, dtype=torch.int32)
    out = rejection_sample(
        torch.randn(B * (k + 1), V, generator=g), torch.randint(0, V, (B * k,), generator=g), num_drafts,
        None,
        torch.full((B,), temperature), torch.zeros(B, dtype=torch.int32), torch.ones(B),
        torch.arange(B, dtype=torch.int64), torch.full((B,), 10, dtype=torch.int64),
        synthetic_acceptance=rates_tensor(forced_rates(length, k)), backend="torch",
    )
    emitted = out.num_tokens.double()
    assert abs(float(emitted.mean()) - length) < 5 * float(emitted.std()) / math.sqrt(B)


def test_both_services_on_a_synthetic_model_accept_at_the_forced_length():
    """Drafter and verifier as real processes on `synthetic:tiny` (random head, shared tensors from the seed):
    the handshake agrees, drafts flow, and the mean acceptance length is the forced one."""
    logs = Path(tempfile.mkdtemp(prefix="specwire-synthetic-"))
    model, k, length = ["--model", "synthetic:tiny", "--device", "cpu"], 3, 2.5
    drafter = start("drafter", ["drafter", *model, "--max-drafts", str(k)], logs)
    verifier = start("verifier", ["verifier", *model, "--k", str(k), "--drafter", f"127.0.0.1:{drafter.port}",
                                  "--forced-acceptance-length", str(length), "--draft-timeout", "30",
                                  # serial drafting: a random head never guesses the target's bonus token, so
                                  # every speculation-cache lookup would miss (and verify with 0 drafts)
                                  "--cache-branches", "0"], logs)
    try:
        wait_serving([drafter, verifier], 120)
        assert wait_drafter_connected(verifier.port, 60), (logs / "verifier.log").read_text()
        totals = [Totals() for _ in range(8)]
        with ThreadPoolExecutor(len(totals)) as pool:
            list(pool.map(lambda t: stream(verifier.port, "Tell me a story.", 120, False, t, ignore_eos=True),
                          totals))
    finally:
        stop([drafter, verifier])
    drafts, accepted = sum(t.drafts for t in totals), sum(t.accepted for t in totals)
    assert all(t.tokens == 120 for t in totals)
    # ~370 rounds; tokens per round have a standard deviation of about 1.1 (0.06 over the mean), and the last
    # round of a request may be cut short by max_tokens.
    assert drafts > 250 and abs(1 + accepted / drafts - length) < 0.3, (drafts, accepted)


def test_generate_runs_a_synthetic_model(capsys):
    assert main(["generate", "--model", "synthetic:tiny", "--device", "cpu", "--prompt", "Hi", "--chat",
                 "--max-tokens", "5", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["tokens"] == 5 and all(0 <= t < SHAPES["tiny"].vocab_size for t in out["token_ids"])


@pytest.mark.parametrize(("k", "length", "message"), [(0, "2", "k >= 1"), (2, "3.5", r"\[1, 3\]")])
def test_the_verifier_refuses_an_impossible_forced_length(capsys, k, length, message):
    argv = ["verifier", "--model", "synthetic:tiny", "--device", "cpu", "--listen", "127.0.0.1:0",
            "--k", str(k), "--forced-acceptance-length", length]
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_gpu_builds_the_same_shared_8b_tensors():
    """What the drafter (one GPU) and the verifier (another) share: the 8B shape's embedding and lm_head."""
    config = synthetic_config("llama-3.1-8b")
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    first = synthetic_weights(config, torch.device("cuda:0"), torch.bfloat16, names)
    for index in range(1, torch.cuda.device_count()):
        other = synthetic_weights(config, torch.device(f"cuda:{index}"), torch.bfloat16, names)
        assert all(torch.equal(first[n], other[n].to("cuda:0")) for n in names)
    assert abs(float(first["lm_head.weight"].float().std()) - 0.02) < 1e-3
