"""The setups bench_services.py puts side by side, as service processes (the `specwire demo` plumbing):

- two_gpus:     a drafter on one device, a verifier on another, over gRPC;
- two_gpus_socket: the same two processes, the per-round Draft stream over the drafter's step socket (the
                handshake over gRPC);
- colocated:    one verifier process that runs the drafter inside it (`--colocated`), on one device;
- colocated_two_gpus: the same process, its drafter on the drafter's device (`--drafter-device`): two GPUs and
                no second process;
- target_only:  a verifier with --k 0 (our engine, no drafter);
- transformers: bench/hf_generate.py in its own process on the verifier's device (see there).

A Fleet starts and stops them and remembers each one's metrics port; a setup whose flags the services do not
know yet (an older checkout) exits at once, and `start` says why instead of failing the whole run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specwire.verifier.drafting_mode import DEFAULT_EPOCH_ROUNDS

from specwire.commands.demo import Service, free_port, start, stop, wait_drafter_connected, wait_serving

SETUPS = ("two_gpus", "two_gpus_socket", "colocated", "colocated_two_gpus", "target_only", "transformers")
TWO_PROCESSES = ("two_gpus", "two_gpus_socket")  # the setups with a drafter process of their own
COLOCATED = ("colocated", "colocated_two_gpus")  # the setups with the drafter in the verifier's process
TWO_GPUS = (*TWO_PROCESSES, "colocated_two_gpus")  # the setups whose drafter runs on the drafter's device
# a forced speculation-cache hit rate, "off" (no cache), "adaptive" (tables or serial, measured), "ahead"
# (queued serial drafting with tables ahead looked up on the drafter's GPU), "ahead:R" (the same, hits forced
# at rate R) or None
HitRate = float | str | None
CACHE_BRANCHES = 8  # default entries per request of the speculation cache's and tables ahead's tables


class SetupUnavailable(RuntimeError):
    """The services refused a setup's flags (not an error of the run)."""


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # a path or synthetic:NAME
    head: str | None  # None: the drafter's default (the shipped head, or a random one for synthetic models)
    lengths: tuple[float | None, ...]  # forced mean acceptance lengths (None: the head's own acceptance)
    verifier_args: tuple[str, ...] = ()  # appended to every speculative verifier's command line
    hit_rates: tuple[HitRate, ...] = (None,)

    @property
    def synthetic(self) -> bool:
        return self.model.startswith("synthetic:")


@dataclass(frozen=True)
class Devices:
    drafter: str | None
    verifier: str | None

    def flag(self, which: str) -> list[str]:
        device = getattr(self, which)
        return ["--device", device] if device else []

    def gpu_indices(self, setup: str) -> list[int]:
        """NVML indices of the GPUs a setup uses (for the busy-share sampler)."""
        devices = [self.drafter, self.verifier] if setup in TWO_GPUS else [self.verifier]
        cuda = [d for d in devices if d and d.startswith("cuda")]
        return sorted({int(d.split(":")[1]) if ":" in d else 0 for d in cuda})


class Fleet:
    """The processes of one bench run: drafters kept per workload, verifiers started per configuration."""

    def __init__(self, devices: Devices, max_batch: int, max_k: int, max_context: int,
                 startup_timeout: float = 240, branches: int = CACHE_BRANCHES):
        self.devices, self.max_batch, self.max_k = devices, max_batch, max_k
        self.max_context, self.timeout, self.branches = max_context, startup_timeout, branches
        self.logs = Path(tempfile.mkdtemp(prefix="specwire-bench-"))
        self.drafters: dict[str, Service] = {}
        self.targets: dict[str, Service] = {}  # per workload: the target-only verifier of --paired points
        self.metrics_ports: dict[str, int] = {}  # service name -> its /metrics port
        self.services: list[Service] = []

    def _start(self, name: str, argv: list[str]) -> Service:
        port = free_port()
        service = start(name, [*argv, "--metrics-port", str(port)], self.logs)
        self.metrics_ports[name] = port
        self.services.append(service)
        try:
            wait_serving([service], self.timeout)
        except ValueError as e:
            self.stop(service)
            if "unrecognized arguments" in service.log.read_text():
                raise SetupUnavailable(f"the {name} refused its flags: {e}") from None
            raise
        return service

    def drafter(self, w: Workload) -> Service:
        if w.name not in self.drafters:
            head = ["--head", w.head] if w.head else []
            self.drafters[w.name] = self._start(f"drafter-{w.name}", [
                "drafter", "--model", w.model, *head, *self.devices.flag("drafter"),
                "--max-drafts", str(self.max_k), "--max-requests", str(max(64, self.max_batch)),
                "--max-context", str(self.max_context), "--max-branches", str(self.branches),
                "--step-socket", self.step_socket(w)])
        return self.drafters[w.name]

    def paired_target(self, w: Workload) -> Service:
        """A target-only verifier kept for the whole run beside the speculative ones (bench_services
        --paired), on the verifier's device."""
        if w.name not in self.targets:
            self.targets[w.name] = self.verifier(w, "target_only", 0, None, role="-paired")
        return self.targets[w.name]

    def step_socket(self, w: Workload) -> str:
        return str(self.logs / f"drafter-{w.name}.sock")

    def verifier(self, w: Workload, setup: str, k: int, length: float | None, hit: HitRate = None,
                 role: str = "") -> Service:
        """A verifier for one configuration (stop it with `stop` when its points are measured); `role` names
        its log apart from another of the same configuration."""
        argv = ["verifier", "--model", w.model, *self.devices.flag("verifier"),
                "--k", str(0 if setup == "target_only" else k), "--max-slots", str(self.max_batch),
                "--max-context", str(self.max_context)]
        if setup in TWO_PROCESSES:
            argv += ["--drafter", f"127.0.0.1:{self.drafter(w).port}"]
            if setup == "two_gpus_socket":
                argv += ["--drafter-socket", self.step_socket(w)]
        elif setup in COLOCATED:
            drafter = self.devices.drafter if setup in TWO_GPUS else self.devices.verifier
            argv += ["--colocated", *(["--head", w.head] if w.head else []),
                     *(["--drafter-device", drafter] if drafter else [])]
        ahead = isinstance(hit, str) and hit.startswith("ahead")
        forced = float(hit.removeprefix("ahead:")) if ahead and ":" in hit else hit
        if setup != "target_only":
            argv += [*(["--forced-acceptance-length", str(length)] if length is not None else []),
                     # said either way: a co-located verifier's default is 0, a remote drafter's 8; and
                     # the drafting mode (a remote drafter's default: adaptive) fixed unless asked for
                     "--cache-branches", "0" if hit == "off" or ahead else str(self.branches),
                     "--drafting-epoch", str(DEFAULT_EPOCH_ROUNDS) if hit == "adaptive" else "0",
                     *(["--queued-tables", str(self.branches)] if ahead else []),
                     # forced rates measure the tables themselves: every round that may asks
                     *(["--queued-tables-epoch", "0"] if ahead and isinstance(forced, float) else []),
                     *(["--forced-hit-rate", str(forced)] if isinstance(forced, float) else []),
                     *w.verifier_args]
        service = self._start(f"verifier-{w.name}-{setup}{role}-k{k}-L{length}-hit{hit}", argv)
        if setup in TWO_PROCESSES and not wait_drafter_connected(service.port, 120):
            self.stop(service)
            raise RuntimeError(f"the verifier never connected to the drafter (logs: {self.logs})")
        return service

    def metrics_port(self, service: Service | None) -> int | None:
        return None if service is None else self.metrics_ports.get(service.name)

    def stop(self, service: Service) -> None:
        stop([service])
        if service in self.services:
            self.services.remove(service)

    def close(self) -> None:
        stop(self.services)
        self.services.clear()


def run_transformers(w: Workload, device: str | None, prompts: list[str], batch_sizes: list[int],
                     temperatures: list[float], max_tokens: int, log_dir: Path, timeout: float) -> dict:
    """bench/hf_generate.py's JSON for one workload (raises with its log's tail when it fails)."""
    prompts_file = log_dir / f"prompts-{w.name}.json"
    prompts_file.write_text(json.dumps(prompts[:max(batch_sizes)]))
    log = log_dir / f"transformers-{w.name}.log"
    argv = [sys.executable, str(Path(__file__).with_name("hf_generate.py")), "--model", w.model,
            "--prompts-json", str(prompts_file), "--batch-sizes", ",".join(map(str, batch_sizes)),
            "--temperatures", ",".join(map(str, temperatures)), "--max-tokens", str(max_tokens),
            *(["--device", device] if device else [])]
    with open(log, "w") as err:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise RuntimeError(f"hf_generate.py exited with {done.returncode}: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])
