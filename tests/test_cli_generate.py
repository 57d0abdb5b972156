"""`specwire generate` against transformers' greedy generate() on the same GGUF, and its one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from specwire.cli import main
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.sampling_params import SamplingParams

PROMPTS = [
    "What is 2+2? Answer with one number.",
    "Say hi.",
    "Write a haiku about the moon.",
    "Explain what a CPU cache is.",
    "List three colours of the rainbow.",
]
MAX_TOKENS = 64
MAX_CONTEXT = "256"  # the prompts + 64 tokens fit; a small cache keeps the CPU attention cheap


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specwire: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, as transformers computes them."""
    results = []
    for prompt in PROMPTS:
        text = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = hf_tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
        results.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    return results


@pytest.mark.slow
def test_greedy_cli_and_batched_engine_match_transformers(capsys, hf_greedy):
    for prompt, (_, expected) in zip(PROMPTS, hf_greedy, strict=True):
        rc, out, _ = run_cli(capsys, "--prompt", prompt, "--chat", "--json", "--max-tokens", str(MAX_TOKENS),
                             "--device", "cpu", "--max-context", MAX_CONTEXT)
        assert rc == 0
        result = json.loads(out)
        assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
        assert result["token_ids"] == expected, prompt
        assert result["finish_reason"] == ("stop" if len(expected) < MAX_TOKENS else "length")
        assert set(result["stats"]) == {"tokens", "seconds", "tokens_per_s"}
        assert result["stats"]["tokens"] == len(expected)

    # All five at once: prompts of different lengths share prefill and decode steps; the queue is longer
    # than the slots, so requests also join while others decode.
    engine = TargetEngine(device="cpu", max_slots=3, max_context=int(MAX_CONTEXT), cuda_graphs=False)
    prompt_ids = [ids for ids, _ in hf_greedy]
    chat = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert [engine.tokenizer.encode(text) for text in chat] == prompt_ids
    results = engine.generate(prompt_ids, [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS))
    assert [r.token_ids for r in results] == [expected for _, expected in hf_greedy]
    assert engine.num_free_slots == 3


def test_missing_model_path(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "--prompt", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_error(rc, err, "nope.gguf")


def write_gguf(path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_non_llama_gguf(capsys, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2")
    rc, _, err = run_cli(capsys, "--prompt", "hi", "--model", str(path))
    assert_one_line_error(rc, err, "gpt2")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_gguf(capsys, tmp_path, keep):
    """Cut inside the metadata and inside the last tensor's data."""
    data = default_model_path().read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)] if keep > 0.9 else data[:4096])
    rc, _, err = run_cli(capsys, "--prompt", "hi", "--model", str(path))
    assert_one_line_error(rc, err, "truncated.gguf")


def test_not_a_gguf(capsys, tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a model" * 100)
    rc, _, err = run_cli(capsys, "--prompt", "hi", "--model", str(path))
    assert_one_line_error(rc, err, "garbage.gguf")


def test_prompt_ids_out_of_range(capsys):
    rc, _, err = run_cli(capsys, "--prompt-ids", "1,2,49152", "--max-tokens", "8", "--device", "cpu",
                         "--max-context", "64")
    assert_one_line_error(rc, err, "49152")


def test_prompt_ids_not_integers(capsys):
    rc, _, err = run_cli(capsys, "--prompt-ids", "1,x")
    assert_one_line_error(rc, err, "'1,x'")


def test_prompt_longer_than_context(capsys):
    rc, _, err = run_cli(capsys, "--prompt-ids", ",".join(["1"] * 40), "--max-tokens", "8",
                         "--device", "cpu", "--max-context", "32")
    assert_one_line_error(rc, err, "40 tokens", "32")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--seed", "-3"], "seed"),
        (["--stop", ""], "stop"),
        (["--device", "cuda:x"], "cuda:x"),
    ],
)
def test_bad_flags(capsys, flags, fragment):
    rc, _, err = run_cli(capsys, "--prompt", "hi", *flags)
    assert_one_line_error(rc, err, fragment)


def test_subprocess_error_has_no_traceback_and_no_grpc():
    """`python -m specwire` as a user runs it: one line on stderr, exit status 2, grpc never imported."""
    code = (
        "import sys; from specwire.cli import main;"
        "rc = main(['generate', '--prompt', 'x', '--top-p', '1.5']);"
        "print('grpc' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.strip() == "False"
    assert proc.stderr.strip().splitlines() == ["specwire: error: top_p must be in (0, 1], got 1.5"]
    help_proc = subprocess.run([sys.executable, "-m", "specwire", "--help"], capture_output=True, text=True,
                               timeout=120)
    assert help_proc.returncode == 0 and "generate" in help_proc.stdout
