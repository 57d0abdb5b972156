"""Clients of the Generation service against a real `specwire drafter` + `specwire verifier` (CPU, the default
SmolLM2 GGUF and the shipped EAGLE head, as processes): `specwire client` and a Node.js client built from the
.proto files alone (@grpc/grpc-js + @grpc/proto-loader, no generated code) both see the greedy tokens and text
of `specwire generate` (target-only, in-process, no gRPC), and the server's in-band errors.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tools import require_tool

from specwire.commands.demo import start, stop, wait_drafter_connected, wait_serving

NODE_DIR = Path(__file__).resolve().parent / "node"
PROMPT = "any language can call Generate"
MAX_TOKENS = 16
K = 3


def _specwire(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specwire", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def reference() -> dict:
    """What a user sees from `specwire generate --json`: target-only greedy decoding, no services."""
    done = _specwire("generate", "--device", "cpu", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                     "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def server_address():
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-node-client-"))
    drafter = start("drafter", ["drafter", "--device", "cpu"], log_dir)
    # Serial drafting, as `specwire demo` runs on a CPU: each round waits for its drafts, so even a short
    # answer is speculative on a loaded machine (tables drafted on the verification's cores come late).
    verifier = start("verifier", ["verifier", "--device", "cpu", "--k", str(K), "--cache-branches", "0",
                                  "--drafter", f"127.0.0.1:{drafter.port}"], log_dir)
    try:
        wait_serving([drafter, verifier], timeout=120)
        assert wait_drafter_connected(verifier.port, 60), "the verifier never connected to the drafter"
        yield f"127.0.0.1:{verifier.port}"
    finally:
        stop([verifier, drafter])
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    install = "apt-get install nodejs npm (make system-tools)"
    node, npm = require_tool("node", install), require_tool("npm", install)
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    if major < 18:
        pytest.skip(f"Node.js {major} is too old: the client needs >= 18 (util.parseArgs)")
    ci = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                        capture_output=True, text=True, timeout=600)
    if ci.returncode != 0:
        message = f"npm ci failed (offline registry?): {ci.stderr.strip().splitlines()[-1:]}"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return [node, str(NODE_DIR / "generate_client.js")]


def _python_client(*args: str) -> subprocess.CompletedProcess:
    return _specwire("client", *args)


def test_python_client_json_matches_generate(server_address, reference):
    done = _python_client("--server", server_address, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                          "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["token_ids"], result["text"]) == (reference["token_ids"], reference["text"])
    assert result["finish_reason"] == reference["finish_reason"]
    stats = result["stats"]
    assert stats["tokens"] == len(reference["token_ids"]) and stats["seconds"] > 0
    assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / stats["seconds"])
    assert 0 < stats["drafts"] <= stats["draft_tokens"] <= K * stats["drafts"]  # the drafter really drafted
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"])


def test_python_client_streams_text(server_address, reference):
    done = _python_client("--server", server_address, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS))
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference["text"]
    assert f"[{len(reference['token_ids'])} tokens" in done.stderr
    assert f"{reference['finish_reason']}]" in done.stderr


def test_python_client_reports_failures(server_address):
    refused = _python_client("--server", server_address, "--prompt", PROMPT, "--top-p", "1.5")
    assert refused.returncode == 1
    assert "INVALID_ARGUMENT: top_p must be in (0, 1], got 1.5" in refused.stderr
    unreachable = _python_client("--server", "127.0.0.1:1", "--prompt", "x", "--timeout", "5")
    assert unreachable.returncode == 1 and "UNAVAILABLE" in unreachable.stderr


def test_node_client_sees_what_python_sees(server_address, reference, node_client):
    args = ["--server", server_address, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)]
    node = subprocess.run([*node_client, *args], capture_output=True, text=True, timeout=60)
    assert node.returncode == 0, node.stderr
    result = json.loads(node.stdout)
    # uint32 token ids arrive as JS numbers; the text is the server's detokenization, chunk by chunk
    assert (result["token_ids"], result["text"]) == (reference["token_ids"], reference["text"])
    assert result["finish_reason"] == f"FINISH_REASON_{reference['finish_reason'].upper()}"
    usage = result["usage"]
    assert usage["completion_tokens"] == len(reference["token_ids"]) and usage["speculative"] is True
    assert int(usage["drafts"]) > 0
    assert result["request_id"].startswith("node-")
    info = result["model_info"]
    assert info["model_name"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert info["speculation"]["drafter_connected"] is True
    assert info["num_running"] == 0  # the finished stream freed its slot


def test_node_client_gets_in_band_errors(server_address, node_client):
    args = ["--server", server_address, "--prompt", PROMPT, "--top-p", "1.5"]
    node = subprocess.run([*node_client, *args], capture_output=True, text=True, timeout=60)
    assert node.returncode == 1 and node.stdout == ""
    assert "ERROR_CODE_INVALID_ARGUMENT: top_p must be in (0, 1], got 1.5" in node.stderr


# ---------------------------------------------------------------- chat messages (system / user / assistant)

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def conversation_reference(hf_tokenizer) -> dict:
    """transformers renders the two-turn conversation with the model's chat template; `specwire generate`
    decodes those ids target-only (in-process, no services)."""
    ids = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    done = _specwire("generate", "--device", "cpu", "--prompt-ids", ",".join(map(str, ids)),
                     "--max-tokens", str(MAX_TOKENS), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) | {"prompt_tokens": len(ids)}


def test_python_client_sends_a_conversation(server_address, conversation_reference, tmp_path):
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION))
    done = _python_client("--server", server_address, "--messages", str(path),
                          "--max-tokens", str(MAX_TOKENS), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["token_ids"], result["text"]) == (conversation_reference["token_ids"],
                                                     conversation_reference["text"])
    assert result["stats"]["prompt_tokens"] == conversation_reference["prompt_tokens"]


def test_python_client_refuses_a_malformed_conversation(server_address, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"role": "robot", "content": "beep"}]))
    refused = _python_client("--server", server_address, "--messages", str(path))
    assert refused.returncode == 1
    roles = "not one of system, user, assistant"
    assert f"INVALID_ARGUMENT: messages[0].role is 'robot', {roles}" in refused.stderr
    path.write_text("{not json")
    bad_flag = _python_client("--server", server_address, "--messages", str(path))
    assert bad_flag.returncode == 2 and "--messages is not JSON" in bad_flag.stderr


def test_node_client_sends_a_two_turn_conversation(server_address, conversation_reference, node_client):
    args = ["--server", server_address, "--messages", json.dumps(CONVERSATION),
            "--max-tokens", str(MAX_TOKENS)]
    node = subprocess.run([*node_client, *args], capture_output=True, text=True, timeout=60)
    assert node.returncode == 0, node.stderr
    result = json.loads(node.stdout)
    assert (result["token_ids"], result["text"]) == (conversation_reference["token_ids"],
                                                     conversation_reference["text"])
    assert result["usage"]["prompt_tokens"] == conversation_reference["prompt_tokens"]
    assert result["usage"]["speculative"] is True
