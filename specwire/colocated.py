"""The co-located mode: a drafter inside the verifier's process, behind the same link as a remote one.

One GPU (or a CPU) serves both; the scheduler, the DraftStep messages and the tables are the ones the
two-process mode uses, only gRPC is left out. This module is the one place that wires the two services
together, so neither service package imports the other.
"""

from __future__ import annotations

import argparse
import functools

import torch

from specwire.drafter.cli import build_proposer
from specwire.drafter.eagle_head import shared_target_weights
from specwire.drafter.server import DrafterService
from specwire.engine import TargetEngine
from specwire.metrics import DrafterMetrics, VerifierMetrics
from specwire.tokenizer import Tokenizer
from specwire.verifier.drafter_link import LocalDrafterLink


def colocated_link(engine: TargetEngine, tokenizer: Tokenizer, metrics: VerifierMetrics, *, head: str | None,
                   device: str | None, k: int, max_branches: int, cuda_graphs: bool,
                   min_confidence: float = 0.0, step_timeout: float = 1.0) -> LocalDrafterLink:
    """A drafter for `engine`'s requests on `device` (default: the engine's), sharing its embedding and
    lm_head (copied when on another device)."""
    shared = shared_target_weights(engine.model)
    args = argparse.Namespace(
        head=head, device=device or str(engine.device), dtype=None, max_requests=engine.max_slots,
        max_context=engine.max_context, max_drafts=max(k, 1), max_top_k=64, max_branches=max_branches,
        no_cuda_graphs=not cuda_graphs, min_confidence=min_confidence,
    )
    with torch.inference_mode():
        proposer, name = build_proposer(args, engine.config, shared)
    service = DrafterService(DrafterMetrics())
    service.load(proposer, engine.config, tokenizer.fingerprint, name)
    owned: set[str] = set()  # the requests of this link's one stream (stream 0)
    return LocalDrafterLink(functools.partial(service.run_step, 0, owned), service.info, service.mismatch,
                            metrics, proposer.device, step_timeout=step_timeout,
                            inline=proposer.device.type == "cuda",
                            queue=functools.partial(service.queue_drafts, 0),
                            take=functools.partial(service.take_drafts, owned),
                            lookups=service.lookups)
