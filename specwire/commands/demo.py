"""`specwire demo`: start a drafter and a verifier as real processes on free localhost ports, stream a few
prompts through the gRPC API, and compare against a target-only verifier (k = 0) of the same code.

Without a shipped or given EAGLE head the drafter is not started and the demo says speculation is off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# On a CPU each draft step costs, so a chain stops where the head is unsure: 2026-11-23 on the 2-core machine,
# speedup 0.96x at 0.3 against 0.88x at 0 (then with a cache of 2 branches; README, "What `make demo` shows").
CPU_MIN_CONFIDENCE = 0.3
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three tips for writing clean Python code.",
    "What is speculative decoding in large language models?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    parser.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped head)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--cache-branches", type=int, default=0,
                        help="speculation-cache table entries per request (default 0: draft each round, "
                             "which measured faster than tables for this model's greedy requests (the "
                             "demo's) on the 2-core CPU and across two GPUs: bench/results/session29/)")
    parser.add_argument("--min-confidence", type=float, default=None,
                        help="the drafter's dynamic draft length (see `specwire drafter --help`; default: "
                             f"{CPU_MIN_CONFIDENCE} on a CPU, where each draft step costs; 0 = off on a GPU)")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a prompt (repeatable; default: four built-in ones)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait for the services to load (default 300)")


@dataclass
class Service:
    name: str
    port: int
    process: subprocess.Popen
    log: Path


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, command: list[str], log_dir: Path) -> Service:
    port = free_port()
    log = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", "specwire", *command, "--listen", f"127.0.0.1:{port}",
            "--log-format", "text"]
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Service(name, port, process, log)


def wait_serving(services: list[Service], timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    for s in services:
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if s.process.poll() is not None:
                    tail = " | ".join(s.log.read_text().strip().splitlines()[-5:])
                    raise ValueError(f"the {s.name} exited with code {s.process.returncode}: {tail}")
                if time.monotonic() > deadline:
                    raise ValueError(f"the {s.name} was not SERVING within {timeout:.0f} s (log: {s.log})")
                with contextlib.suppress(grpc.RpcError):
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                time.sleep(0.2)


def stop(services: list[Service]) -> None:
    """SIGTERM (each drains), then wait; kill only what does not exit."""
    for s in services:
        if s.process.poll() is None:
            s.process.send_signal(signal.SIGTERM)
    for s in services:
        try:
            s.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.process.kill()
            s.process.wait()


def stream(port: int, prompt: str, max_tokens: int, echo: bool, totals: Totals, ignore_eos: bool = False
           ) -> None:
    """One greedy chat request, added to `totals`; prints the text as it arrives when `echo`."""
    import grpc

    from specwire.v1 import generation_pb2 as pb
    from specwire.v1 import generation_pb2_grpc

    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    request = pb.GenerateRequest(text=prompt, chat=True, sampling=sampling)
    ids: list[int] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        started = time.perf_counter()
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600):
            kind = response.WhichOneof("event")
            if kind == "error":
                raise ValueError(f"the verifier refused the prompt: {response.error.message}")
            if kind == "chunk":
                ids += response.chunk.token_ids
                if echo:
                    print(response.chunk.text, end="", flush=True)
            elif kind == "complete":
                totals.seconds += time.perf_counter() - started
                totals.drafts += response.complete.usage.drafts
                totals.accepted += response.complete.usage.accepted_tokens
        totals.tokens += len(ids)
        totals.outputs.append(ids)


def wait_drafter_connected(port: int, timeout: float) -> bool:
    import grpc

    from specwire.v1 import generation_pb2 as pb
    from specwire.v1 import generation_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            if stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).speculation.drafter_connected:
                return True
            time.sleep(0.2)
    return False


def on_gpu(args: argparse.Namespace) -> bool:
    import torch

    return args.device.startswith("cuda") if args.device else torch.cuda.is_available()


def default_min_confidence(args: argparse.Namespace) -> float:
    return 0.0 if on_gpu(args) else CPU_MIN_CONFIDENCE


def run(args: argparse.Namespace) -> int:
    from specwire.default_model import resolve_model_path
    from specwire.drafter.cli import DEFAULT_HEAD

    model = str(resolve_model_path(args.model))
    head = Path(args.head) if args.head else DEFAULT_HEAD
    if args.head and not (head / "config.json").is_file():
        raise ValueError(f"--head {args.head} has no config.json")
    speculate = (head / "config.json").is_file() and args.k > 0
    prompts = args.prompt or list(PROMPTS)
    common = ["--model", model, *(["--device", args.device] if args.device else [])]
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-demo-"))
    services: list[Service] = []
    try:
        target_only = start("target-only verifier", ["verifier", *common, "--k", "0"], log_dir)
        services.append(target_only)
        if speculate:
            branches = str(args.cache_branches)
            confidence = default_min_confidence(args) if args.min_confidence is None else args.min_confidence
            drafter = start("drafter", ["drafter", *common, "--head", str(head), "--max-drafts", str(args.k),
                                        "--max-branches", branches, "--max-requests", "16",
                                        "--min-confidence", str(confidence)], log_dir)
            verifier = start("verifier", ["verifier", *common, "--k", str(args.k), "--cache-branches",
                                          branches, "--drafter", f"127.0.0.1:{drafter.port}"], log_dir)
            services += [drafter, verifier]
            print(f"drafter :{drafter.port} ({head.name}) + verifier :{verifier.port} (k = {args.k}), "
                  f"target-only verifier :{target_only.port}; logs in {log_dir}", flush=True)
        else:
            verifier = target_only
            print(f"no EAGLE head at {head}: speculation is off (train one with `specwire train-eagle` or "
                  f"pass --head). Target-only verifier :{target_only.port}; logs in {log_dir}", flush=True)
        wait_serving(services, args.startup_timeout)
        if speculate and not wait_drafter_connected(verifier.port, 60):
            print("warning: the verifier has not connected to the drafter; it decodes alone", flush=True)
        for port in {s.port for s in services if s.name.endswith("verifier")}:
            stream(port, "Hi", 4, echo=False, totals=Totals())  # warm-up: first-call compilation, allocation

        # Each prompt goes to the speculative verifier and then to the target-only one, so that a slow spell
        # of a shared machine falls on both sides of the ratio rather than on one.
        spec, base = Totals(), Totals()
        for prompt in prompts:
            print(f"\n>>> {prompt}\n", flush=True)
            stream(verifier.port, prompt, args.max_tokens, echo=True, totals=spec)
            print(flush=True)
            if speculate:
                stream(target_only.port, prompt, args.max_tokens, echo=False, totals=base)
        print()
        if not speculate:
            print(f"target-only: {spec.tokens} tokens in {spec.seconds:.2f} s = "
                  f"{spec.tokens_per_s:.1f} tokens/s (speculation off)")
            return 0
        mean_length = 1 + spec.accepted / spec.drafts if spec.drafts else 0.0
        same = "yes" if spec.outputs == base.outputs else "NO"
        print(f"speculative (k = {args.k}): {spec.tokens} tokens in {spec.seconds:.2f} s = "
              f"{spec.tokens_per_s:.1f} tokens/s, mean acceptance length {mean_length:.2f}")
        print(f"target-only:         {base.tokens} tokens in {base.seconds:.2f} s = "
              f"{base.tokens_per_s:.1f} tokens/s")
        speedup = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        print(f"speedup {speedup:.2f}x; greedy output identical to target-only: {same}")
        return 0 if same == "yes" else 1
    finally:
        stop(services)
