"""Host time of turning a speculation-cache table into its DraftResult, on the CPU: the drafter's
`_branch_tables` (reading the branch loop's outputs) and `encode_tensor` of each sampled branch's q, for
16 requests x 8 branches x 4 drafts at T = 1 (top-16 q), the bs16 T = 1 point of the services benchmark. The
head's own compute is not timed. Uses the tests' tiny target and head (tests/test_drafter_proposer.py).

    python bench/bench_table_host.py --out bench/results/table_host_cpu.json
"""

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import specwire.drafter.server as server  # noqa: E402
from test_drafter_proposer import Setup  # noqa: E402

from specwire.metrics import DrafterMetrics  # noqa: E402
from specwire.v1 import drafter_pb2 as pb  # noqa: E402

REQUESTS, BRANCHES, DRAFTS, ROUNDS = 16, 8, 4, 12


def timed(fn, seconds: list[float]):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    s = Setup(Path(tempfile.mkdtemp()), "eagle1", max_branches=BRANCHES, max_requests=REQUESTS,
              max_context=256, max_drafts=DRAFTS, max_top_k=16)
    service = server.DrafterService(DrafterMetrics())
    service.proposer = proposer = s.proposer
    for b in range(REQUESTS):
        s.add(f"0/r{b}", 9)
        service._known[f"0/r{b}"] = 9
    tables, encodes = [], []
    proposer._branch_tables = timed(proposer._branch_tables, tables)
    server.encode_tensor = timed(server.encode_tensor, encodes)
    wants = [pb.DraftWant(request_id=f"r{b}", num_drafts=DRAFTS, temperature=1.0, top_k=16,
                          num_branches=BRANCHES) for b in range(REQUESTS)]
    for _ in range(ROUNDS):
        service._draft_tables(0, wants, pb.DraftResult())
        for b in range(REQUESTS):  # one settled token each, so the next table can be drafted
            proposer.update(f"0/r{b}", [5], torch.randn(1, s.head.config.feature_dim))
    per_table = len(encodes) // ROUNDS
    result = {
        "command": " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "point": {"requests": REQUESTS, "branches": BRANCHES, "drafts": DRAFTS, "temperature": 1.0,
                  "top_k": 16},
        "branch_tables_ms_median": 1e3 * statistics.median(tables[2:]),
        "encode_tensor_us_median": 1e6 * statistics.median(encodes),
        "encode_tensor_calls_per_table": per_table,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
