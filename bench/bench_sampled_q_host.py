"""Host time of a serial step's sampled drafts on the CPU: the drafter packing each request's sparse q into
its DraftResult (DrafterService._split) and the verifier checking them (alignment.read_result), or, with the
drafter in the verifier's process, the link handing them over without a message (_drafts_by_request), at a
batch of requests with k drafts each from a top-K q over SmolLM2's vocabulary. Prints one line per function:
the mean of --calls calls after 20 warm-up ones.

    python bench/bench_sampled_q_host.py --batch 16 --k 4 --top-k 64
"""

from __future__ import annotations

import argparse
import timeit

import torch
from specwire.drafter.proposer import Proposal
from specwire.drafter.server import DrafterService
from specwire.kernels.rejection_sampler import DraftProbs
from specwire.verifier.alignment import Want, read_result
from specwire.verifier.drafter_link import _drafts_by_request

from specwire.metrics import DrafterMetrics
from specwire.v1 import drafter_pb2 as pb

VOCAB = 49152  # SmolLM2's


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    B, k, K = args.batch, args.k, args.top_k
    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(VOCAB, generator=g)[:K] for _ in range(B * k)])
    values = torch.rand(B * k, K, generator=g)
    values /= values.sum(1, keepdim=True)
    proposal = Proposal(indices[:, 0].clone(), torch.full((B,), k, dtype=torch.int32),
                        DraftProbs.sparse(indices, values))
    wants = [pb.DraftWant(request_id=str(i), num_drafts=k, temperature=1.0, top_k=K) for i in range(B)]
    service = DrafterService(DrafterMetrics())

    def split() -> pb.DraftResult:
        result = pb.DraftResult()
        service._split(wants, proposal, [1.0] * B, [K] * B, result)
        return result

    result = split()
    asked = {str(i): Want(k, 1.0, K) for i in range(B)}
    assert len(read_result(result, asked, VOCAB).drafts) == B  # every proposal passes its checks
    in_process = [str(i) for i in range(B)], list(asked.values()), proposal
    for name, fn in (("DrafterService._split", split),
                     ("alignment.read_result", lambda: read_result(result, asked, VOCAB)),
                     ("drafter_link._drafts_by_request", lambda: _drafts_by_request(*in_process))):
        timeit.timeit(fn, number=20)
        us = timeit.timeit(fn, number=args.calls) / args.calls * 1e6
        print(f"{name}: {us:,.0f} us a step (batch {B}, k {k}, top-{K})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
