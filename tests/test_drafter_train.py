"""train-eagle on a tiny random target (CPU): runs end to end within its budget, writes a loadable head."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from specwire.drafter.eagle_head import load_eagle_head
from specwire.drafter.self_distill import prompt_text

from specwire.cli import main
from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.model import LlamaModel
from specwire.tokenizer import load_tokenizer
from specwire.weights import load_checkpoint

DATA = [  # one record per supported prompt field
    {"instruction": "Name three fruits.", "instances": [{"input": ""}]},
    {"instruction": "Translate to French.", "instances": [{"input": "Good morning"}]},
    {"instruction": "Write a haiku about rain.", "instances": [{"input": ""}]},
    {"instruction": "List two prime numbers.", "instances": [{"input": ""}]},
]


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
    shapes = LlamaModel(config, device="meta").expected_shapes()
    save_file({n: torch.randn(s, generator=g) * 0.5 for n, s in shapes.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(hf))
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({**tok.special_tokens, "chat_template": tok.chat_template})
    )
    return path


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "prompts").mkdir()
    lines = [json.dumps(r) for r in DATA]
    (root / "prompts" / "self_instruct_seed_tasks.jsonl").write_text("\n".join(lines) + "\n")
    (root / "prompts" / "gsm8k_train.jsonl").write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n")
    return root


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_train_eagle_smoke_writes_a_loadable_head(tiny_target, data_dir, tmp_path, capsys, arch):
    out = tmp_path / "head"
    rc = main(
        [
            "train-eagle",
            "--model",
            str(tiny_target),
            "--data-dir",
            str(data_dir),
            "--out",
            str(out),
            "--arch",
            arch,
            "--device",
            "cpu",
            "--max-minutes",
            "0.6",
            "--max-new-tokens",
            "12",
            "--self-instruct",
            "2",
            "--gen-batch",
            "4",
            "--holdout",
            "0.2",
            "--epochs",
            "2",
            "--draft-vocab",
            "512",
            "--write-heldout",
            str(tmp_path / "heldout.jsonl"),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] > 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["train_conversations"] >= 4 and log["data"]["held_out_conversations"] == 1
    assert 0.0 <= log["held_out"][-1]["top1_1"] <= 1.0
    heldout = [json.loads(line)["prompt"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 1 and heldout[0] in ["What is 2 + 3?", *map(prompt_text, DATA)]
    config, sd = load_checkpoint(tiny_target)
    head = load_eagle_head(out, config, sd)
    assert head.config.arch == arch
    assert head.config.aux_layers == ((2, 3, 3) if arch == "eagle3" else ())
    saved = json.loads((out / "config.json").read_text())
    assert saved["specwire"]["arch"] == arch and saved["torch_dtype"] == "bfloat16"


def test_train_eagle_rejects_bad_budget(tiny_target, data_dir, tmp_path, capsys):
    rc = main(
        [
            "train-eagle",
            "--model",
            str(tiny_target),
            "--data-dir",
            str(data_dir),
            "--out",
            str(tmp_path),
            "--max-minutes",
            "0",
            "--device",
            "cpu",
        ]
    )
    assert rc == 2 and "--max-minutes must be > 0" in capsys.readouterr().err
