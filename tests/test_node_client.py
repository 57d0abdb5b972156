"""Clients of the Generation service: `specwire client` and a Node.js client built from the .proto files alone
(@grpc/grpc-js + @grpc/proto-loader, no generated code) agree on what a real server streams.

The server is tests/toy_generation.py run as a process; to test against the real verifier, change only the
command in `server_address`.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toy_generation import expected_output

TESTS = Path(__file__).resolve().parent
NODE_DIR = TESTS / "node"


@pytest.fixture(scope="module")
def server_address():
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(TESTS / "toy_generation.py"), "0.0", "5"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = int(proc.stdout.readline().split()[0])
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the Node.js client test (apt-get install nodejs npm)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    if major < 18:
        pytest.skip(f"Node.js {major} is too old: the client needs >= 18 (util.parseArgs)")
    ci = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                        capture_output=True, text=True, timeout=600)
    if ci.returncode != 0:
        pytest.skip(f"npm ci failed (offline registry?): {ci.stderr.strip().splitlines()[-1:]}")
    return [node, str(NODE_DIR / "generate_client.js")]


def _python_client(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from specwire.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "client", *args], capture_output=True, text=True,
                          timeout=60)


def test_python_client_json(server_address):
    done = _python_client("--server", server_address, "--prompt", "hello world", "--max-tokens", "6",
                          "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["text"] == expected_output("hello world", 6).decode() == "HELLO "
    assert result["token_ids"] == list(b"HELLO ")
    assert result["finish_reason"] == "length"
    stats = result["stats"]
    assert stats["tokens"] == 6 and stats["seconds"] > 0
    assert stats["tokens_per_s"] == pytest.approx(6 / stats["seconds"])
    assert (stats["drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (3, 6, 3)
    assert stats["mean_acceptance_length"] == 2.0


def test_python_client_streams_text(server_address):
    done = _python_client("--server", server_address, "--prompt", "stream me")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "STREAM ME"
    assert "[9 tokens" in done.stderr and "stop]" in done.stderr


def test_python_client_reports_failures(server_address):
    refused = _python_client("--server", server_address, "--prompt", "")
    assert refused.returncode == 1
    assert "INVALID_ARGUMENT: the toy server takes non-empty text prompts" in refused.stderr
    unreachable = _python_client("--server", "127.0.0.1:1", "--prompt", "x", "--timeout", "5")
    assert unreachable.returncode == 1 and "UNAVAILABLE" in unreachable.stderr


def test_node_client_matches_python_client(server_address, node_client):
    prompt = "any language can call Generate"
    args = ["--server", server_address, "--prompt", prompt, "--max-tokens", "20"]
    node = subprocess.run([*node_client, *args], capture_output=True, text=True, timeout=60)
    assert node.returncode == 0, node.stderr
    from_node = json.loads(node.stdout)
    python = _python_client(*args, "--json")
    from_python = json.loads(python.stdout)
    assert from_node["text"] == from_python["text"] == expected_output(prompt, 20).decode()
    assert from_node["token_ids"] == from_python["token_ids"]
    assert from_node["finish_reason"] == "FINISH_REASON_LENGTH" and from_python["finish_reason"] == "length"
    assert from_node["usage"]["completion_tokens"] == 20 and from_node["usage"]["speculative"] is True
    assert from_node["request_id"].startswith("node-")
    assert from_node["model_info"]["model_name"] == "toy-bytes"
    assert from_node["model_info"]["num_running"] == 0  # the finished stream freed its slot
