"""EagleProposer: batched chain drafting with an EAGLE head, its own KV cache and CUDA graphs.

Pairing: the target feature of position t goes with token t + 1. A request's pairs wait as "pending" until the
next propose(), whose first step feeds them all (the head's prefill) and whose last pending output drafts d_1;
each further step feeds (d_j, the head's own output feature) and drafts d_{j+1}. Draft positions are never
committed: the next round's pending pairs (the accepted tokens) overwrite them.

On CUDA the whole k-step loop (first step of up to k + 1 pending pairs, then k - 1 single-token steps,
sampling included) is one CUDA graph per padded batch size and sampling mode (greedy / top-K / full q).
Every step's positions and lengths are derived inside the graph from per-row metadata written before each
replay; pad rows carry safe metadata (0 tokens, trash slot, gather index 0, greedy). Probabilities live in
float32 buffers owned here and written by replay.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from specwire.drafter.draft_sampling import sample_drafts
from specwire.drafter.eagle_head import EagleHead
from specwire.kernels import table_lookup
from specwire.kernels.rejection_sampler import DraftProbs

from specwire import round_trace
from specwire.engine import (
    PREFILL_GRAPH_TOKENS,
    PREFILL_ROW,
    PrefillRows,
    StepGraphs,
    capture,
    on_own_device,
    prefill_capture_sizes,
    prefill_rows,
)
from specwire.model import KVCache
from specwire.staging import Readback, StagedInputs, read_back, upload
from specwire.wire import as_numpy


class ProposerError(ValueError):
    """Bad input to the proposer (unknown request, wrong shapes, out of capacity)."""


# draft_branches' `verifying` entry for "the chain of the request's last propose(keep_chain=True)".
VERIFYING_CHAIN = -1


class Branch(NamedTuple):
    """One entry of a speculation-cache table: drafts for the outcome "the verification in flight accepts
    `accepted` drafts and the target adds `bonus`" (target ids; q as in Proposal, rows of this branch)."""

    index: int
    accepted: int
    bonus: int
    token_ids: list[int]
    q_indices: torch.Tensor | None  # [k, K] int32 target ids, -1 = unused slot; None for greedy drafts
    q_values: torch.Tensor | None  # [k, K] float32


class Proposal(NamedTuple):
    token_ids: torch.Tensor  # [sum k_b] int64 target ids, on the CPU, in the order of propose's request_ids
    num_drafts: torch.Tensor  # [B] int32 on the CPU; below the asked k near the end of the context
    probs: DraftProbs | None  # None when every row is greedy; sparse when every sampled row is top-K


class RequestDrafts(NamedTuple):
    """One request's drafts from a Proposal, q cut back to the kind it asked for (host arrays)."""

    index: int  # the request's position in the proposal
    token_ids: list[int]
    dense: np.ndarray | None  # [k, V] float32: untruncated sampling (top_k 0)
    sparse: tuple[np.ndarray, np.ndarray] | None  # (indices [k, K], values [k, K] float32): top-K sampling


def drafts_per_request(proposal: Proposal, temperature: list[float], top_k: list[int],
                       index_dtype: torch.dtype) -> Iterator[RequestDrafts]:
    """Each request's drafts, skipping those without any: greedy rows (temperature 0) carry no q, top_k 0
    rows their dense q, the rest their top-K (indices as index_dtype). Each tensor comes to the host in one
    copy and is sliced there in numpy (torch calls per request took 0.3-0.6 ms a batch-16 step on the 2-core
    CPU: bench/bench_sampled_q_host.py)."""
    ids, counts, q = read_back(proposal.token_ids).tolist(), proposal.num_drafts.tolist(), proposal.probs
    dense = sparse = None
    if q is not None and q.is_dense:
        dense = read_back(q.probs).numpy()
    elif q is not None:
        sparse = read_back(q.indices.to(index_dtype)).numpy(), read_back(q.values.float()).numpy()
    start = 0
    for i, (k, t, width) in enumerate(zip(counts, temperature, top_k, strict=True)):
        rows, start = slice(start, start + k), start + k
        if k == 0:
            continue
        if t == 0:
            yield RequestDrafts(i, ids[rows], None, None)
        elif width == 0:
            yield RequestDrafts(i, ids[rows], dense[rows], None)
        elif sparse is not None:
            yield RequestDrafts(i, ids[rows], None, (sparse[0][rows, :width], sparse[1][rows, :width]))
        else:  # a dense batch: this row's support is its top-K, so topk is exact
            values, indices = torch.from_numpy(dense[rows]).topk(width, dim=1)
            yield RequestDrafts(i, ids[rows], None, (indices.to(index_dtype).numpy(), values.numpy()))


@dataclass
class _Branch:
    slot: int  # holds the main slot's prefix, the branch's bonus and its drafts (own-feature K/V)
    accepted: int
    bonus: int
    token_ids: list[int]
    row: int  # its row among the request's max_branches rows of the branch loop's outputs


@dataclass
class _Request:
    slot: int
    num_cached: int = 0  # pairs whose K/V are committed in the head's cache
    pending_tokens: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)
    branches: list[_Branch] = field(default_factory=list)  # the last table drafted for this request
    verifying: list[int] = field(default_factory=list)  # drafts (target ids) the verifier checks now
    chain: list[int] | None = None  # the drafts of a propose(keep_chain=True), while nothing settled since
    # Where its last table's rows start in the branch loop's outputs, which table call drafted it and with
    # how many drafts a branch (a queued lookup reads it there only while no other call has drafted since).
    table_at: int = -1
    table_call: int = 0
    table_drafts: int = 0

    @property
    def num_pending(self) -> int:
        return len(self.pending_tokens)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch (padding wastes at most 7 rows past 8)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


class EagleProposer:
    # Rows of the int32 metadata block rewritten before every run.
    _SLOT, _START, _PENDING, _DRAFTS, _TOP_K = range(5)

    def __init__(
        self,
        head: EagleHead,
        max_requests: int = 64,
        max_context: int = 2048,
        max_drafts: int = 4,
        max_top_k: int = 64,
        cuda_graphs: bool = True,
        max_branches: int = 0,
        uniform_outcomes: bool = False,
        min_confidence: float = 0.0,
    ):
        """cuda_graphs=False forces eager execution on CUDA; CPU always runs eagerly. max_branches: entries
        per request of a speculation-cache table (draft_branches); each takes a KV slot of its own.
        uniform_outcomes: score every number of accepted drafts alike instead of by the head's q (for random
        heads in synthetic benchmarks, whose q would put every branch at 0 accepted).
        min_confidence: dynamic draft length (EAGLE-2's depth rule): a chain stops before the first draft
        after its first whose step has a top probability (softmax of the head's logits) below it, so k is a
        maximum; an eager loop stops once every row has stopped. The first draft is always kept: the
        verifier has paid for the round trip by then, and verifying one draft costs about a decode step.
        0 keeps every chain at its k."""
        if max_drafts < 1:
            raise ProposerError(f"max_drafts must be >= 1, got {max_drafts}")
        if not 1 <= max_top_k <= head.vocab_size:
            raise ProposerError(f"max_top_k must be in [1, {head.vocab_size}], got {max_top_k}")
        if not 0 <= max_branches <= head.vocab_size:
            raise ProposerError(f"max_branches must be in [0, {head.vocab_size}], got {max_branches}")
        if not 0.0 <= min_confidence < 1.0:
            raise ProposerError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        self.head, self.device = head, head.device
        self.max_requests, self.max_context, self.max_drafts = max_requests, max_context, max_drafts
        self.max_top_k, self.max_branches, self.uniform_outcomes = max_top_k, max_branches, uniform_outcomes
        num_slots = max_requests * (1 + max_branches)
        self.cache = KVCache.allocate(head.config.layer, num_slots, max_context, head.dtype, self.device)
        self.requests: dict[str, _Request] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))

        n, T, K, dev = max_requests, max_drafts + 1, max_drafts, self.device
        self._T = T
        # Inputs of every run, written on the host and sent over in one copy (features last: a batch sends
        # only its rows of them).
        self._inputs = StagedInputs({
            "meta": ((5, n), torch.int32), "temperature": ((n,), torch.float32),
            "input_ids": ((n, T), torch.int64), "feature_cells": ((n * T,), torch.int64),
            "settled_rows": ((n,), torch.int64), "table_rows": ((n,), torch.int64),
            "features": ((n, T, head.config.feature_dim), head.dtype),
        }, dev)
        (self._meta, self._temperature, self._input_ids, self._feature_cells, self._settled_rows,
         self._table_rows, self._features) = self._inputs.tensors.values()
        self._queued: tuple | None = None  # queue_after_verification's rows, until take_queued
        # With tables ahead: the last queue's requests with a table to look in, the last take's hits and
        # whether its drafts were the tables'.
        self.last_lookups, self.last_hits, self.tables_served = 0, 0, False
        self._settled_counts = torch.zeros(0, dtype=torch.int64)  # its rows' settled counts, on the device
        # Outputs, written by every (replayed) run: the proposer's own float32 buffers.
        self._tokens = torch.zeros(n, K, dtype=torch.int64, device=dev)
        self._top_idx = torch.zeros(n, K, max_top_k, dtype=torch.int64, device=dev)
        self._top_q = torch.zeros(n, K, max_top_k, dtype=torch.float32, device=dev)
        self._full_q = torch.zeros(n, K, head.vocab_size, dtype=torch.float32, device=dev)
        self._confident = torch.zeros(n, dtype=torch.int64, device=dev)  # drafts before a step below it
        self._meta[self._SLOT] = self.cache.trash_slot
        self._inputs.host["meta"][self._SLOT] = self.cache.trash_slot
        if max_branches:
            self._init_branch_buffers()

        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.graph_sizes = graph_batch_sizes(max_requests) if cuda_graphs and dev.type == "cuda" else []
        self._prefill_graphs: StepGraphs | None = None
        if self.graph_sizes:
            self._capture()
            self._capture_prefill()

    # ------------------------------------------------------------------------------------ requests

    # add and update launch nothing of their own (torch guards a dtype cast's device itself): no device
    # scope, which cost a switch there and back per request and step.
    def add(self, request_id: str, token_ids: list[int], features: torch.Tensor) -> None:
        """A new request: its tokens so far (prompt + first sampled token) and the target features of all
        but the last token ([len(token_ids) - 1, feature_dim])."""
        if request_id in self.requests:
            raise ProposerError(f"request {request_id!r} already exists")
        if len(self.requests) >= self.max_requests:
            raise ProposerError(f"all {self.max_requests} drafter slots are in use")
        if len(token_ids) < 2:
            raise ProposerError(f"request {request_id!r} needs at least 2 tokens, got {len(token_ids)}")
        request = _Request(self._free_slots[-1])
        self._append(request_id, request, token_ids[1:], features)
        self.requests[request_id] = request
        self._free_slots.pop()

    def update(self, request_id: str, accepted_token_ids: list[int], features: torch.Tensor) -> None:
        """After verification: the request's new tokens and the target features of the positions before
        each of them (the verified [last token, accepted drafts]): one feature per new token."""
        self._append(request_id, self._get(request_id), accepted_token_ids, features)

    def free(self, request_id: str) -> None:
        request = self._get(request_id)
        self._release_branches(request)
        self._free_slots.append(request.slot)
        del self.requests[request_id]

    def _get(self, request_id: str) -> _Request:
        if request_id not in self.requests:
            raise ProposerError(f"unknown request {request_id!r}")
        return self.requests[request_id]

    def _append(self, request_id: str, request: _Request, tokens: list[int], features: torch.Tensor) -> None:
        F = self.head.config.feature_dim
        if features.dim() != 2 or features.shape != (len(tokens), F):
            raise ProposerError(
                f"request {request_id!r}: features of shape {tuple(features.shape)}, "
                f"expected ({len(tokens)}, {F})"
            )
        vocab = self.head.config.target_vocab_size
        if bad := [t for t in tokens if not 0 <= t < vocab]:
            raise ProposerError(f"request {request_id!r}: token id {bad[0]} out of range [0, {vocab})")
        if request.num_cached + request.num_pending + len(tokens) > self.max_context:
            raise ProposerError(f"request {request_id!r} exceeds the drafter context of {self.max_context}")
        request.pending_tokens += tokens
        request.chain = None  # tokens settled after it: a table can no longer be asked for its check
        # Kept on the host until propose(), which sends every request's pending features over in one copy;
        # features already on a GPU (a co-located verifier's) stay there. By type: "cuda" names no index.
        home = self.device if features.device.type == self.device.type else torch.device("cpu")
        request.pending_features.append(features.to(home, self.head.dtype))

    # ------------------------------------------------------------------------------------ propose

    @torch.no_grad()
    @on_own_device
    def propose(
        self,
        request_ids: list[str],
        num_drafts: list[int],
        temperature: list[float],
        top_k: list[int],
        keep_chain: bool = False,
    ) -> Proposal:
        """Draft num_drafts[b] tokens (0..max_drafts) for each request; temperature 0 drafts greedily, else
        samples from softmax(logits / T) truncated to the top_k[b] logits (0 = the full vocabulary).

        A request's last table, if any, is dropped: the verifier asks for drafts because it missed.
        keep_chain (a drafter with branch slots): a table will be asked for while the verifier checks these
        drafts (draft_branches with VERIFYING_CHAIN). The head's outputs after each draft stay in the slot as
        a branch leaves them, and the last settled pair stays pending, so that table's first step re-feeds
        it (the same K/V) and reads the output that predicts the first draft."""
        B = len(request_ids)
        requests = self._checked(request_ids, num_drafts, temperature, top_k)
        for rid, req, k in zip(request_ids, requests, num_drafts, strict=True):
            if k > 0 and req.num_pending == 0:
                raise ProposerError(f"request {rid!r} has no new tokens since its last proposal")
        if keep_chain and not self.max_branches:
            raise ProposerError("keep_chain needs branch slots (this drafter has max_branches = 0)")
        if B == 0:
            return self._empty_proposal()
        for r in requests:
            self._take_branch(r, None)
        round_trace.mark("d.branches_taken")
        self._prefill_overflow(requests)
        round_trace.mark("d.prefilled")
        # Drafts write positions num_cached + pending .. + k - 2: clip k at the end of the context.
        ks = [
            min(k, self.max_context - r.num_cached - r.num_pending + 1)
            for r, k in zip(requests, num_drafts, strict=True)
        ]
        size = next((s for s in self.graph_sizes if s >= B), B)
        self._load_batch(requests, ks, temperature, top_k, size)
        sampled = [tk for t, tk, k in zip(temperature, top_k, ks, strict=True) if t > 0 and k > 0]
        mode = "greedy" if not sampled else "top_k" if all(sampled) else "full"
        graph = self.graphs.get((size, f"chain_{mode}" if keep_chain else mode))
        round_trace.mark("d.loaded")
        if graph is not None:
            graph.replay()
        else:  # eager: no step past the longest chain
            self._draft_loop(size, mode, steps=max(ks), keep_chain=keep_chain)
        round_trace.mark("d.launched")
        for r in requests:
            last = (r.pending_tokens[-1:], [r.pending_features[-1][-1:]] if r.num_pending else [])
            r.num_cached += r.num_pending
            r.pending_tokens, r.pending_features = [], []
            if keep_chain:
                r.num_cached -= len(last[0])
                r.pending_tokens, r.pending_features = last
        proposal = self._proposal(ks, temperature, top_k)
        round_trace.mark("d.drafts")
        if keep_chain:
            ids, first = proposal.token_ids.tolist(), 0
            for r, k in zip(requests, proposal.num_drafts.tolist(), strict=True):
                r.chain, first = ids[first:first + k], first + k
        return proposal

    def _checked(self, request_ids: list[str], num_drafts: list[int], temperature: list[float],
                 top_k: list[int]) -> list[_Request]:
        """The requests of a draft call, its per-request arguments checked."""
        if not len(num_drafts) == len(temperature) == len(top_k) == len(request_ids):
            raise ProposerError(
                "request_ids, num_drafts, temperature and top_k must have one entry per request"
            )
        if len(set(request_ids)) != len(request_ids):
            raise ProposerError("request_ids has duplicates")
        if self._queued is not None:
            raise ProposerError("drafts queued after a verification are not taken yet (take_queued)")
        requests = [self._get(r) for r in request_ids]
        for rid, k, t, tk in zip(request_ids, num_drafts, temperature, top_k, strict=True):
            if not 0 <= k <= self.max_drafts:
                raise ProposerError(f"num_drafts {k} for {rid!r} out of range [0, {self.max_drafts}]")
            if not t >= 0:
                raise ProposerError(f"temperature {t} for {rid!r} must be >= 0")
            if not 0 <= tk <= self.max_top_k:
                raise ProposerError(f"top_k {tk} for {rid!r} out of range [0, {self.max_top_k}]")
        return requests

    @torch.no_grad()
    @on_own_device
    def queue_after_verification(
        self,
        request_ids: list[str],
        settled: torch.Tensor,
        rows: list[int],
        features: torch.Tensor,
        feature_cells: list[int],
        num_drafts: list[int],
        temperature: list[float],
        top_k: list[int],
        num_branches: list[int] | None = None,
        forced_hit_rate: float | None = None,
        publish: table_lookup.Publish | None = None,
    ) -> None:
        """Serial drafting that never returns to the host between a verification and its next drafts: the
        draft of the tokens a verification settles is queued on the device right behind its sampler, before
        the host knows them. take_queued(counts) then reads the drafts and commits the settled tokens.

        settled: the sampler's packed output [N, >= 2] int64 (per row: how many tokens it settled, -1 for a
        failed row, then the tokens), on any device; rows[b]: request b's row of it. features: [M,
        feature_dim] on this device (a co-located verifier's feature store, flattened), and feature_cells[b *
        (max_drafts + 1) + j] its row holding the target feature before request b's j-th settled token (rows
        past what settles are read and ignored). A request must have nothing pending: its last tokens were
        drafted from (propose, or a queue taken). num_drafts as propose's, clipped so that any number of
        settled tokens fits the context.

        num_branches (greedy rows, a drafter with branch slots): tables ahead. Each request's table, drafted
        by the last take_queued while this verification ran, is looked up on the device first, from the
        sampler's output: if every request's outcome is in its table, those branches' drafts are the
        round's, ready before the serial drafting has run: with `publish`, the device itself copies them
        into the verifier's buffer and writes the step's number (table_lookup.look_up). The serial drafting
        runs all the same (it keeps its chain for the next table) and its drafts are the round's when some
        request missed. forced_hit_rate (synthetic benchmarks, whose random heads hit nothing): a request
        whose table has a branch for the number of drafts accepted takes the likeliest of them at this rate,
        as if its bonus token were that branch's."""
        B, T = len(request_ids), self._T
        requests = self._checked(request_ids, num_drafts, temperature, top_k)
        tables = num_branches is not None
        if not len(rows) == B or len(feature_cells) != B * T or (tables and len(num_branches) != B):
            raise ProposerError(f"rows, feature_cells and num_branches need {B}, {B * T} and {B} entries, "
                                f"got {len(rows)}, {len(feature_cells)} and {len(num_branches or ())}")
        greedy = all(t == 0 for t in temperature)
        if tables and not (self.max_branches and greedy and not self.min_confidence):
            raise ProposerError("tables ahead need branch slots (max_branches > 0), greedy rows and fixed "
                                "draft counts (min_confidence 0)")
        if pending := [rid for rid, r in zip(request_ids, requests, strict=True) if r.num_pending]:
            raise ProposerError(f"request {pending[0]!r} has tokens pending: not drafted on the device")
        if B == 0:
            return
        if not tables:  # (with tables, the branches stay until take_queued knows which one was checked)
            for r in requests:
                self._take_branch(r, None)
        ks = [max(0, min(k, self.max_context - r.num_cached - T + 1))
              for r, k in zip(requests, num_drafts, strict=True)]
        size = next((s for s in self.graph_sizes if s >= B), B)
        self._inputs.wait_free()
        self._stage_meta(requests, [0] * B, ks, temperature, top_k, size)  # pending: from `settled` below
        host = self._inputs.host
        host["input_ids"][:size] = 0
        host["feature_cells"][:B * T] = feature_cells
        host["settled_rows"][:B] = rows
        self.last_lookups, self.last_hits, self.tables_served = 0, 0, False  # (take_queued's, with tables)
        if tables:  # a table is looked up only where it is the last call's and drafted as many as asked now
            first = [r.table_at if r.table_call == self._table_calls and r.table_drafts == k else -1
                     for r, k in zip(requests, ks, strict=True)]
            host["table_rows"][:B] = first
            self.last_lookups = sum(f >= 0 for f in first)
        self._inputs.send("features", 0)
        round_trace.mark("d.staged")
        mine = settled.to(self.device, non_blocking=True).index_select(0, self._settled_rows[:B])
        round_trace.mark("d.settled_copied")
        if tables:
            self._look_up_tables(mine, forced_hit_rate, publish)
            round_trace.mark("d.looked_up")
        width = min(T, mine.shape[1] - 1)
        self._meta[self._PENDING, :B] = mine[:, 0].clamp(0, T)
        self._input_ids[:B, :width] = mine[:, 1:1 + width].clamp_min(0)  # -1 pads past the settled ones
        self._settled_counts = mine[:, 0]
        F = self.head.config.feature_dim
        if features.device == self.device:
            torch.index_select(features, 0, self._feature_cells[:B * T],
                               out=self._features[:B].view(B * T, F))
        else:  # a same-host verifier's table on its GPU: copies only, which wait for this device's stream
            # (a gather there would not); a request's cells are consecutive rows (repeats past its context
            # end are never settled), so one copy each
            for b in range(B):
                first = feature_cells[b * T]
                rows = min(T, features.shape[0] - first)
                self._features[b, :rows].copy_(features[first:first + rows], non_blocking=True)
        sampled = [tk for t, tk, k in zip(temperature, top_k, ks, strict=True) if t > 0 and k > 0]
        mode = "greedy" if not sampled else "top_k" if all(sampled) else "full"
        graph = self.graphs.get((size, f"chain_{mode}" if tables else mode))
        if graph is not None:
            graph.replay()
        else:
            self._draft_loop(size, mode, steps=max(ks), keep_chain=tables)
        if tables:  # the round's drafts: the tables' where every request hit (as they were published)
            self._tokens[:B].copy_(torch.where(self._all_hit != 0, self._hit_drafts[:B], self._tokens[:B]))
        self._queued = (request_ids, requests, num_drafts, ks, temperature, top_k, num_branches)

    def _look_up_tables(self, settled: torch.Tensor, forced_hit_rate: float | None,
                        publish: table_lookup.Publish | None) -> None:
        """The lookup of each queued request's last table (_table_rows[b]: where its rows start, -1 none)
        from its sampler row settled[b], into _hit_index, _hit_drafts and _all_hit; then, queued before the
        serial drafting, their copy to the host (take_queued reads them without waiting for that drafting)."""
        B, rows = settled.shape[0], self.max_requests * self.max_branches
        draws = (None if forced_hit_rate is None
                 else torch.rand(B, generator=self._forcing, device=self.device))
        table = table_lookup.Table(self._branch_slots.view(-1)[:rows], self._br_score, self._br_accepted,
                                   self._br_bonus, self._br_tokens, self.cache.trash_slot, self.max_branches)
        lookup = table_lookup.Lookup(self._hit_index, self._hit_drafts, self._all_hit)
        table_lookup.look_up(settled, self._row_ids[:B], self._table_rows[:B], table, draws,
                             forced_hit_rate or 0.0, lookup, publish)
        self._looked_up.start(torch.cat([self._hit_index[:B, None], settled], 1))

    def queued_drafts(self, n: int) -> torch.Tensor:
        """The draft ids of the last queue_after_verification's n requests, [n, max_drafts] on this device, as
        the queued work leaves them (cells past a request's drafts hold ids of no meaning)."""
        return self._tokens[:n]

    def queued_counts(self) -> list[int]:
        """How many tokens each request of the last queue_after_verification settled (0 for a failed row),
        read once its sampler is done: for a drafter that is not told them."""
        if self._queued is not None and self._queued[-1] is not None:  # tables ahead: read with the lookup
            return self._looked_up.wait()[:, 1].clamp_min(0).tolist()
        return read_back(self._settled_counts).clamp_min(0).tolist()

    def take_queued(self, counts: list[int], on_device: bool = False) -> Proposal:
        """The drafts queued by queue_after_verification (waits for them), once the host has read how many
        tokens each request settled (its sampler count, 0 for a failed row): those tokens are committed.
        on_device: the draft ids stay on this device as well, not waited for (unless dynamic depth must
        read how many are confident). With tables ahead, the next tables are drafted before this returns
        (last_hits: how many requests hit; tables_served: whether the drafts are the tables')."""
        if self._queued is None:
            return self._empty_proposal()
        (request_ids, requests, num_drafts, ks, temperature, top_k, num_branches), self._queued = (
            self._queued, None)
        if len(counts) != len(requests):
            raise ProposerError(f"{len(counts)} counts for {len(requests)} queued requests")
        if num_branches is not None:
            return self._take_tables(request_ids, requests, counts, num_drafts, ks, num_branches, on_device)
        for r, n in zip(requests, counts, strict=True):
            r.num_cached += n
        return self._proposal(ks, temperature, top_k, on_device)

    def _take_tables(self, request_ids: list[str], requests: list[_Request], counts: list[int],
                     num_drafts: list[int], ks: list[int], num_branches: list[int], on_device: bool
                     ) -> Proposal:
        """take_queued with tables ahead: every request goes on from the drafts the verifier now checks (its
        hit branch where all hit, else the serial chain, kept), and the tables for that check are drafted
        from the settled tokens with the target's features. Where all hit, nothing here waits for the serial
        drafting: the lookup's results came back on their own (_look_up_tables)."""
        B = len(requests)
        looked_up = self._looked_up.wait()
        hit_rows, settled = looked_up[:, 0].tolist(), looked_up[:, 2:].tolist()
        features = self._features[:B].clone()  # the settled tokens' target features (the next load reuses it)
        self.last_hits = sum(i >= 0 for i in hit_rows)
        self.tables_served = self.last_hits == B
        chains = None if self.tables_served else read_back(self._tokens[:B]).tolist()  # waits for them
        verifying, drafting, served = [], [], []
        for b, (r, n) in enumerate(zip(requests, counts, strict=True)):
            if n == 0:  # a failed row: nothing settled, no table
                self._take_branch(r, None)
                continue
            if self.tables_served:  # its branch's slot holds the prefix and those drafts: commit all n
                index = next(i for i, branch in enumerate(r.branches) if branch.row == hit_rows[b])
                branch = r.branches[index]
                # (a forced hit's bonus token is taken to be the branch's, as forcing at the verifier did)
                r.pending_tokens = r.verifying[:branch.accepted] + [branch.bonus]
                r.pending_features = [features[b, :n]]
                verifying.append(index)
                served.append(branch.token_ids)
            else:  # the chain's K/V follow the settled ones; the last settled pair is re-fed by the table
                r.num_cached += n - 1
                r.pending_tokens, r.pending_features = [settled[b][n - 1]], [features[b, n - 1:n]]
                r.chain = chains[b][:ks[b]]
                verifying.append(VERIFYING_CHAIN)
            drafting.append(b)
        if self.tables_served:  # (every request settled a token, so every one has its branch's drafts)
            ids = torch.tensor([t for chain in served for t in chain], dtype=torch.int64)
            proposal = Proposal(upload(ids, self.device) if on_device else ids,
                                torch.tensor([len(chain) for chain in served], dtype=torch.int32), None)
        else:
            proposal = self._proposal(ks, [0.0] * B, [0] * B, on_device)
        round_trace.mark("d.tables_taken", B)
        if drafting:
            self.draft_branches([request_ids[b] for b in drafting], verifying,
                                [num_branches[b] for b in drafting], [num_drafts[b] for b in drafting],
                                [0.0] * len(drafting), [0] * len(drafting))
        return proposal

    def _prefill_overflow(self, requests: list[_Request]) -> None:
        """Commit pending pairs beyond the graph's first-step width (new prompts), keeping one: cut into rows
        (engine.PrefillRows), a prefill graph's worth of rows a forward."""
        rows = [r for r in requests if r.num_pending > self._T]
        if not rows:
            return
        counts = [r.num_pending - 1 for r in rows]
        features = [torch.cat(r.pending_features) for r in rows]  # each request's, joined once
        grid = prefill_rows([(r.slot, r.pending_tokens[:n]) for r, n in zip(rows, counts, strict=True)],
                            PREFILL_ROW, [r.num_cached for r in rows])
        fed = torch.cat([joined[:n] for joined, n in zip(features, counts, strict=True)])
        fed = fed.to(self.device, self.head.dtype)
        first = 0
        for chunk in grid.chunks(PREFILL_GRAPH_TOKENS // PREFILL_ROW):
            self._prefill_rows(chunk, fed[first:first + len(chunk.cells)])
            first += len(chunk.cells)
        for r, n, joined in zip(rows, counts, features, strict=True):
            r.num_cached += n
            r.pending_tokens, r.pending_features = r.pending_tokens[n:], [joined[n:]]

    def _prefill_rows(self, rows: PrefillRows, features: torch.Tensor) -> None:
        """The head's forward over one chunk of prompt rows, `features` at its cells: by the prefill graph
        where there is one, else eagerly."""
        F = self.head.config.feature_dim
        if self._prefill_graphs is not None:
            grid = self._prefill_features
        else:
            grid = torch.zeros(len(rows.slots), PREFILL_ROW, F, dtype=self.head.dtype, device=self.device)
        grid.view(-1, F).index_copy_(0, upload(torch.tensor(rows.cells), self.device), features)
        if self._prefill_graphs is not None:
            self._prefill_graphs.replay_rows(rows)
            return
        self.head(torch.from_numpy(rows.tokens).to(self.device), grid, *rows.columns(self.device),
                  self.cache.k[0], self.cache.v[0])

    def _load_batch(
        self, requests: list[_Request], ks: list[int], temperature: list[float], top_k: list[int], size: int
    ) -> None:
        """Rewrite every input of rows [0, size) on the host, live rows from the requests, the rest as
        padding (trash slot, nothing pending, greedy), then send them over in one copy. Features already on
        the device (a co-located verifier's) go into their cells after it in one gather, whose cell indices
        travel in that copy (and the copy leaves the features out when all are on the device)."""
        T = self._T
        self._inputs.wait_free()
        round_trace.mark("d.inputs_free")
        self._stage_meta(requests, [r.num_pending for r in requests], ks, temperature, top_k, size)
        ids, cells, features = (self._inputs.host[n] for n in ("input_ids", "feature_cells", "features"))
        ids[:size] = 0
        on_device, num_cells, host_rows = [], 0, False  # on_device: features to put in cells[:num_cells]
        for b, r in enumerate(requests):
            ids[b, :r.num_pending] = r.pending_tokens
            first = 0
            for rows in r.pending_features:
                if rows.device.type == "cpu":
                    features[b, first:first + len(rows)] = as_numpy(rows)
                    host_rows = True
                else:
                    on_device.append(rows)
                    start = b * T + first
                    cells[num_cells:num_cells + len(rows)] = np.arange(start, start + len(rows))
                    num_cells += len(rows)
                first += len(rows)
        self._inputs.send("features", size if host_rows else 0)
        if on_device:  # one gather: a copy per request took 0.28 ms of a batch-16 step (session 17)
            joined = torch.cat(on_device) if len(on_device) > 1 else on_device[0]
            self._features.view(-1, joined.shape[1]).index_copy_(0, self._feature_cells[:num_cells], joined)

    def _stage_meta(self, requests: list[_Request], pending: list[int], ks: list[int],
                    temperature: list[float], top_k: list[int], size: int) -> None:
        """Rows [0, size) of the metadata and temperatures on the host: the requests', then padding (trash
        slot, nothing pending, greedy)."""
        B, meta, temps = len(requests), self._inputs.host["meta"], self._inputs.host["temperature"]
        meta[:, :B] = [[r.slot for r in requests], [r.num_cached for r in requests], pending, ks, top_k]
        meta[:, B:size] = np.array([[self.cache.trash_slot], [0], [0], [0], [0]])
        temps[:B], temps[B:size] = temperature, 0.0

    def _draft_loop(self, size: int, mode: str, steps: int | None = None, keep_chain: bool = False) -> None:
        """The graph body: first step over the pending pairs, then max_drafts - 1 single-token steps.

        Per-step metadata comes from the per-row block: step j feeds position start + pending + j - 1, one
        token while j < k (else 0 tokens: nothing is written to a live slot). keep_chain also feeds the last
        draft and keeps, per slot, each draft's draft-vocabulary id and the head's output after it, which a
        table for its check scores.
        """
        head, meta = self.head, self._meta[:, :size]
        slots, start, pending, drafts, top_k = (meta[i] for i in range(5))
        kc, vc = self.cache.k[0], self.cache.v[0]
        T = self._T
        out = head(self._input_ids[:size], self._features[:size], start, pending, slots, kc, vc)
        last = torch.arange(size, device=self.device) * T + (pending.long() - 1).clamp_min(0)
        hidden = out.flatten(0, 1).index_select(0, last)  # pad rows gather index 0*T + 0
        position = start + pending
        eager = steps is not None
        steps = self.max_drafts if steps is None else max(steps, 1)
        confident = self._confident[:size]
        confident.zero_()
        slot_rows = slots.long() if keep_chain else None  # index of the per-slot chain buffers
        for j in range(steps):
            logits = head.logits(hidden)
            if self.min_confidence and not self._count_confident(logits, confident, j, eager):
                break
            sample = sample_drafts(logits, self._temperature[:size], top_k, self.max_top_k, mode)
            tokens = sample.tokens if head.draft_to_target is None else head.draft_to_target[sample.tokens]
            self._tokens[:size, j].copy_(tokens)
            if sample.top_q is not None:
                self._top_idx[:size, j].copy_(sample.top_idx)
                self._top_q[:size, j].copy_(sample.top_q)
            if sample.full_q is not None:
                self._full_q[:size, j].copy_(sample.full_q)
            if keep_chain:
                self._slot_draft_ids[:, j].index_copy_(0, slot_rows, sample.tokens)
            elif j + 1 == steps:
                break
            # Draft j + 1 is fed if a later draft needs it or, keeping the chain, if it is drafted and fits.
            live = (drafts > j) & (position < self.max_context) if keep_chain else drafts > j + 1
            hidden = head(tokens[:, None], hidden[:, None], position, live.int(), slots, kc, vc,
                          own_features=True)[:, 0]
            if keep_chain:
                self._slot_hidden[:, j].index_copy_(0, slot_rows, hidden)
            position = position + 1

    def _count_confident(self, logits: torch.Tensor, confident: torch.Tensor, step: int, eager: bool) -> bool:
        """Dynamic depth: confident[b] counts the drafts of row b before its first step after the first whose
        top probability is below min_confidence. Returns False when an eager loop can stop (no row is still
        confident; a captured graph never asks, as that would wait for the device)."""
        top = (logits.amax(-1) - logits.logsumexp(-1)).exp()
        still = (confident == step) & ((top >= self.min_confidence) | (step == 0))
        confident.add_(still.long())
        return not eager or bool(still.any())

    @on_own_device
    def _capture(self) -> None:
        """One graph per (padded batch size, sampling mode) of each loop; all share one memory pool.
        Branch-table graphs ("branch_greedy", "branch_top_k") and chain-keeping ones ("chain_greedy",
        "chain_top_k") exist when max_branches > 0."""
        pool = None
        loops = [(mode, functools.partial(self._draft_loop, mode=mode))
                 for mode in ("greedy", "top_k", "full")]
        if self.max_branches:
            loops += [(f"branch_{mode}", functools.partial(self._branch_loop, mode=mode))
                      for mode in ("greedy", "top_k")]
            loops += [(f"chain_{mode}", functools.partial(self._draft_loop, mode=mode, keep_chain=True))
                      for mode in ("greedy", "top_k")]
        for name, loop in loops:
            loop(self.graph_sizes[-1])  # warm-up: compiles the Triton kernels; rows padding
            torch.cuda.synchronize()
            for size in reversed(self.graph_sizes):  # largest first, so smaller graphs reuse its memory
                graph = torch.cuda.CUDAGraph()
                with capture(graph, pool):
                    loop(size)
                pool = graph.pool()
                self.graphs[size, name] = graph
        torch.cuda.synchronize()

    @on_own_device
    def _capture_prefill(self) -> None:
        """The head's forward over new prompts cut into rows (engine.PrefillRows), as the target's prefill:
        eager, it is tens of launches from Python for every new request, on the drafter's critical path."""
        rows, F = PREFILL_GRAPH_TOKENS // PREFILL_ROW, self.head.config.feature_dim
        self._prefill_features = torch.zeros(rows, PREFILL_ROW, F, dtype=self.head.dtype, device=self.device)

        def forward(ids, start_pos, num_tokens, slots, logits_index) -> torch.Tensor:
            return self.head(ids, self._prefill_features[:ids.shape[0]], start_pos, num_tokens, slots,
                             self.cache.k[0], self.cache.v[0])

        self._prefill_graphs = StepGraphs(forward, self.device, self.cache.trash_slot, rows, PREFILL_ROW,
                                          sizes=prefill_capture_sizes(rows))

    # ------------------------------------------------------------------------------------ branch tables

    def _init_branch_buffers(self) -> None:
        """Per-slot state a branch leaves for the round after it is hit, and the branch loop's outputs."""
        n, N, K, dev = self.max_requests, self.max_branches, self.max_drafts, self.device
        slots = self.cache.num_slots + 1
        H = self.head.config.layer.hidden_size
        # Per slot: the head's outputs after feeding each draft (they score the next table), and the drafts'
        # draft-vocabulary ids (the bonus after rejecting draft j is not draft j).
        self._slot_hidden = torch.zeros(slots, K, H, dtype=self.head.dtype, device=dev)
        self._slot_draft_ids = torch.zeros(slots, K, dtype=torch.int64, device=dev)
        self._num_verifying = torch.zeros(n, dtype=torch.int64, device=dev)
        self._branch_slots = torch.full((n, N), self.cache.trash_slot, dtype=torch.int64, device=dev)
        rows = n * N
        self._br_accepted = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._br_bonus = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._br_score = torch.zeros(rows, dtype=torch.float32, device=dev)
        self._br_tokens = torch.zeros(rows, K, dtype=torch.int64, device=dev)
        self._br_top_idx = torch.zeros(rows, K, self.max_top_k, dtype=torch.int64, device=dev)
        self._br_top_q = torch.zeros(rows, K, self.max_top_k, dtype=torch.float32, device=dev)
        self._br_confident = torch.zeros(rows, dtype=torch.int64, device=dev)
        # A queued round's lookup of the last tables (queue_after_verification with num_branches).
        self._table_calls = 0  # draft_branches calls so far: only the last one's rows are in the outputs
        self._hit_index = torch.zeros(n, dtype=torch.int64, device=dev)
        self._hit_drafts = torch.zeros(n, K, dtype=torch.int64, device=dev)
        self._all_hit = torch.zeros((), dtype=torch.int32, device=dev)
        self._row_ids = torch.arange(n, device=dev)
        self._looked_up = Readback()  # per queued request: its hit, then its sampler row (count, tokens)
        self._forcing = torch.Generator(device=dev).manual_seed(0)  # forced_hit_rate's draws
        if dev.type == "cuda":  # the lookup's programs compiled now, not in a request's round
            settled = torch.full((1, K + 2), -1, dtype=torch.int64, device=dev)
            cells = torch.zeros(n * K, dtype=torch.int64, device=dev)
            for draws in (None, torch.ones(1, device=dev)):
                for publish in (None, table_lookup.Publish(cells, cells[:1], 0)):
                    self._look_up_tables(settled, None if draws is None else 0.0, publish)
            torch.cuda.synchronize(dev)

    def _release_branches(self, request: _Request, keep: _Branch | None = None) -> None:
        self._free_slots += [b.slot for b in request.branches if b is not keep]
        request.branches, request.table_at = [], -1

    @staticmethod
    def _check_branch(request_id: str, request: _Request, index: int | None) -> None:
        """Branch `index` of the request's last table exists and its outcome is what settled; or the chain
        (VERIFYING_CHAIN) was kept and nothing settled since."""
        if index is None:
            return
        if index == VERIFYING_CHAIN:
            if request.chain is None:
                raise ProposerError(f"request {request_id!r}: no chain to verify (none was proposed with "
                                    f"keep_chain, or tokens settled after it)")
            return
        if not 0 <= index < len(request.branches):
            raise ProposerError(f"request {request_id!r}: no branch {index} in its last table "
                                f"({len(request.branches)} branches)")
        branch = request.branches[index]
        settled = request.verifying[:branch.accepted] + [branch.bonus]
        if request.pending_tokens != settled:
            raise ProposerError(f"request {request_id!r}: settled tokens {request.pending_tokens} do not "
                                f"match branch {index} ({settled})")

    def _take_branch(self, request: _Request, index: int | None) -> None:
        """The verifier now checks branch `index` of the request's last table (None: no drafts;
        VERIFYING_CHAIN: the kept chain, whose K/V are in the request's own slot). A branch's slot becomes the
        request's: the prefix there is the main slot's, and its drafts' K/V are already in."""
        if index is None or index == VERIFYING_CHAIN:
            self._release_branches(request)
            request.verifying = request.chain if index == VERIFYING_CHAIN else []
            request.chain = None
            return
        branch = request.branches[index]
        self._release_branches(request, keep=branch)
        self._free_slots.append(request.slot)
        request.slot, request.verifying = branch.slot, branch.token_ids

    @torch.no_grad()
    @on_own_device
    def draft_branches(
        self,
        request_ids: list[str],
        verifying: list[int | None],
        num_branches: list[int],
        num_drafts: list[int],
        temperature: list[float],
        top_k: list[int],
    ) -> list[list[Branch]]:
        """A speculation-cache table per request, drafted while the verifier checks its drafts.

        verifying[b]: which branch of request b's previous table the verifier checks now (None: it checks
        no drafts; VERIFYING_CHAIN: the drafts of its last propose(keep_chain=True)). The request's pending
        tokens must be what settled the round before (for a branch: its accepted drafts and its bonus; for
        the chain: the last settled token again, left pending by propose). First those are committed with
        the target's features (the K/V built from the head's own features are overwritten), then the
        outcomes of the check in flight, (a accepted, bonus c), are scored by the head: P(a) * q(c) with
        P(a) the product of q over the accepted drafts and c never the rejected draft. The num_branches[b]
        likeliest get num_drafts[b] drafts each, in slots of their own, sampled as propose() samples
        (greedy, or top-K with the exact q shipped).
        """
        B = len(request_ids)
        if not self.max_branches:
            raise ProposerError("this drafter was built without branch slots (max_branches = 0)")
        if not len(verifying) == len(num_branches) == B:
            raise ProposerError("every argument of draft_branches needs one entry per request")
        requests = self._checked(request_ids, num_drafts, temperature, top_k)
        for rid, n, t, tk in zip(request_ids, num_branches, temperature, top_k, strict=True):
            if not 0 <= n <= self.max_branches:
                raise ProposerError(f"num_branches {n} for {rid!r} out of range [0, {self.max_branches}]")
            if t > 0 and tk == 0:
                raise ProposerError(f"request {rid!r}: branch drafts are greedy or top-K sampled "
                                    f"(temperature {t}, top_k {tk}; top_k in [1, {self.max_top_k}])")
        for rid, req, index in zip(request_ids, requests, verifying, strict=True):
            self._check_branch(rid, req, index)
            if req.num_pending == 0:
                raise ProposerError(f"request {rid!r} has no settled tokens since its last table")
        for req, index in zip(requests, verifying, strict=True):  # only once all are known to be good
            self._take_branch(req, index)
        if B == 0:
            return []
        self._prefill_overflow(requests)
        # Branch (j, c) feeds c at position cached + pending + j and its drafts after it: clip at the context.
        ks = [max(0, min(k, self.max_context - 1 - r.num_cached - r.num_pending - len(r.verifying)))
              for r, k in zip(requests, num_drafts, strict=True)]
        counts = [n if k > 0 else 0 for n, k in zip(num_branches, ks, strict=True)]
        size = next((s for s in self.graph_sizes if s >= B), B)
        self._load_batch(requests, ks, temperature, top_k, size)
        N, trash = self.max_branches, self.cache.trash_slot
        slots = [[self._free_slots.pop() if i < n else trash for i in range(N)] for n in counts]
        slots += [[trash] * N] * (size - B)
        upload(torch.tensor(slots), self._branch_slots[:size])
        verifying_counts = [len(r.verifying) for r in requests] + [0] * (size - B)
        upload(torch.tensor(verifying_counts), self._num_verifying[:size])
        mode = "branch_greedy" if all(t == 0 for t in temperature) else "branch_top_k"
        self._table_calls += 1
        for b, (r, k, n) in enumerate(zip(requests, ks, counts, strict=True)):
            r.table_at, r.table_call, r.table_drafts = b * N if n else -1, self._table_calls, k
        round_trace.mark("d.loaded")
        if (size, mode) in self.graphs:
            self.graphs[size, mode].replay()
        else:  # eager: copy only the prefix any branch can see
            longest = max(r.num_cached + r.num_pending + len(r.verifying) for r in requests)
            self._branch_loop(size, mode.removeprefix("branch_"), copy_len=longest, steps=max(ks))
        round_trace.mark("d.launched")
        for r in requests:
            r.num_cached += r.num_pending
            r.pending_tokens, r.pending_features = [], []
        return self._branch_tables(requests, slots, counts, ks, temperature)

    def _branch_loop(self, size: int, mode: str, copy_len: int | None = None, steps: int | None = None
                     ) -> None:
        """The branch-table graph body: commit the pending pairs, score the outcomes, copy each chosen
        branch's prefix into its slot, then feed its bonus and draft (max_drafts + 1 single-token steps: the
        last only leaves the head's output after the last draft, for the next table's scores)."""
        head, meta, N, K, T = self.head, self._meta[:, :size], self.max_branches, self.max_drafts, self._T
        slots, start, pending, drafts, top_k = (meta[i] for i in range(5))
        kc, vc = self.cache.k[0], self.cache.v[0]
        out = head(self._input_ids[:size], self._features[:size], start, pending, slots, kc, vc)
        last = torch.arange(size, device=self.device) * T + (pending.long() - 1).clamp_min(0)
        committed = out.flatten(0, 1).index_select(0, last)
        # Outcome a = j: the next token is predicted by the committed output (j = 0) or by the head's output
        # after verifying draft j (kept in the slot by the branch that drafted them).
        slots = slots.long()
        hidden = torch.cat([committed[:, None], self._slot_hidden.index_select(0, slots)], 1)  # [n, K+1, H]
        temperature = self._temperature[:size]
        inv_t = torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-6), 1.0)
        q = torch.softmax(head.logits(hidden) * inv_t[:, None, None], -1)
        drafted = self._slot_draft_ids.index_select(0, slots)  # [n, K]
        checked = torch.arange(K, device=self.device) < self._num_verifying[:size, None]
        q_drafted = q[:, :K].gather(2, drafted[..., None])[..., 0]
        reach = torch.cumprod(torch.where(checked, 1.0 if self.uniform_outcomes else q_drafted, 0.0), 1)
        reach = torch.cat([torch.ones_like(reach[:, :1]), reach], 1)  # P(the first j drafts are accepted)
        q[:, :K].scatter_(2, drafted[..., None], torch.where(checked, 0.0, q_drafted)[..., None])
        score, accepted, bonus = self._pick_outcomes(reach, q)
        accepted, bonus = accepted.flatten(), bonus.flatten()

        rows = size * N
        branch_slots = self._branch_slots[:size].flatten()
        owner = torch.arange(size, device=self.device).repeat_interleave(N)
        main = slots.index_select(0, owner)
        for cache in (kc, vc):
            view = cache if copy_len is None else cache[:, :, :copy_len]
            view.index_copy_(0, branch_slots, view.index_select(0, main))
        position = ((start + pending).index_select(0, owner) + accepted).int()
        k_row = drafts.index_select(0, owner)
        head_slots = branch_slots.int()
        feature = hidden.flatten(0, 1).index_select(0, owner * (K + 1) + accepted)
        to_target = head.draft_to_target
        token = bonus if to_target is None else to_target[bonus]
        row_temperature, row_top_k = temperature.index_select(0, owner), top_k.index_select(0, owner)
        self._br_accepted[:rows].copy_(accepted)
        self._br_bonus[:rows].copy_(token)
        self._br_score[:rows].copy_(score.flatten())
        eager = steps is not None
        steps = K if steps is None else steps  # eager runs stop at the longest chain asked for
        confident = self._br_confident[:rows]
        confident.zero_()
        for j in range(steps + 1):
            live = (k_row >= max(j, 1)).int()
            feature = head(token[:, None], feature[:, None], position + j, live, head_slots, kc, vc,
                           own_features=True)[:, 0]
            if j > 0:
                self._slot_hidden[:, j - 1].index_copy_(0, branch_slots, feature)
            if j == steps:
                break
            logits = head.logits(feature)
            if self.min_confidence and not self._count_confident(logits, confident, j, eager):
                break
            sample = sample_drafts(logits, row_temperature, row_top_k, self.max_top_k, mode)
            self._slot_draft_ids[:, j].index_copy_(0, branch_slots, sample.tokens)
            token = sample.tokens if to_target is None else to_target[sample.tokens]
            self._br_tokens[:rows, j].copy_(token)
            if sample.top_q is not None:
                self._br_top_idx[:rows, j].copy_(sample.top_idx)
                self._br_top_q[:rows, j].copy_(sample.top_q)

    def _pick_outcomes(self, reach: torch.Tensor, q: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A table's N outcomes (accepted drafts a, bonus token) per request, [n, N] each, with scores (0: an
        outcome the check in flight cannot have). reach [n, K+1] = P(a drafts accepted); q [n, K+1, V] the
        bonus token's distribution after a. By probability, reach * q; uniform_outcomes deals them in turn
        to every reachable a, each a's likeliest bonus tokens first (a random head's q would pile them on a
        few a, and a forced hit rate could not be met for the others)."""
        N = self.max_branches
        if not self.uniform_outcomes:
            score, flat = (reach[..., None] * q).flatten(1).topk(N, dim=1)
            return score, flat // q.shape[-1], flat % q.shape[-1]
        top_q, top_idx = q.topk(N, dim=2)  # [n, K+1, N]
        turn = torch.arange(N, 0, -1, device=q.device, dtype=q.dtype)  # an a's best bonus goes first
        _, flat = (reach[..., None] * (turn + 0.5 * top_q)).flatten(1).topk(N, dim=1)
        score = (reach[..., None] * top_q).flatten(1).gather(1, flat)
        return score, flat // N, top_idx.flatten(1).gather(1, flat)

    def _branch_tables(self, requests: list[_Request], slots: list[list[int]], counts: list[int],
                       ks: list[int], temperature: list[float]) -> list[list[Branch]]:
        """Reads the branch loop's outputs into per-request tables; remembers the branches."""
        N, rows = self.max_branches, len(requests) * self.max_branches
        # Per branch: accepted, bonus, possible (score > 0), confident drafts, then its drafts; every integer
        # of the table in one copy back, which is the one wait for the device.
        columns = torch.cat([self._br_accepted[:rows, None], self._br_bonus[:rows, None],
                             (self._br_score[:rows, None] > 0).long(), self._br_confident[:rows, None],
                             self._br_tokens[:rows]], 1)
        columns = read_back(columns).tolist()
        round_trace.mark("d.drafts")
        if any(t > 0 for t in temperature):  # q as each branch ships it, for all rows at once: a few large
            to_target = self.head.draft_to_target  # ops and copies instead of several tiny ones per branch
            top_q = self._br_top_q[:rows]
            top_idx = self._br_top_idx[:rows]
            top_idx = torch.where(top_q > 0, top_idx if to_target is None else to_target[top_idx], -1).int()
            top_q, top_idx = read_back(top_q), read_back(top_idx)
            support = (top_q > 0).sum(2).tolist()  # [rows, K]: the width of each draft's q
        tables = []
        for b, (r, n, k, t) in enumerate(zip(requests, counts, ks, temperature, strict=True)):
            table = []
            for i in range(n):
                row = b * N + i
                accepted, bonus, possible, confident, *tokens = columns[row]
                if not possible:  # an outcome the check in flight cannot have: return its slot
                    self._free_slots.append(slots[b][i])
                    continue
                ids = tokens[:min(k, confident if self.min_confidence else k)]
                r.branches.append(_Branch(slots[b][i], accepted, bonus, ids, i))
                q_idx = q_val = None
                if t > 0 and ids:
                    n = len(ids)
                    width = max(1, *support[row][:n])
                    q_val, q_idx = top_q[row, :n, :width], top_idx[row, :n, :width]
                table.append(Branch(len(r.branches) - 1, accepted, bonus, ids, q_idx, q_val))
            tables.append(table)
        return tables

    # ------------------------------------------------------------------------------------ outputs

    def _empty_proposal(self) -> Proposal:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return Proposal(empty, torch.zeros(0, dtype=torch.int32), None)

    def _proposal(self, ks: list[int], temperature: list[float], top_k: list[int], on_device: bool = False
                  ) -> Proposal:
        """Pack rows [b, :k_b] of the output buffers (k_b cut at the row's confident drafts under dynamic
        depth); choose the smallest exact q payload. on_device: token ids as a tensor on this device, read
        by no one here (the host learns k_b, so it waits only for dynamic depth)."""
        if self.min_confidence:
            ks = [min(k, n) for k, n in zip(ks, read_back(self._confident[:len(ks)]).tolist(), strict=True)]
        K = self.max_drafts
        sampled = [(t, tk) for t, tk, k in zip(temperature, top_k, ks, strict=True) if t > 0 and k > 0]
        whole = all(k == K for k in ks)  # every row drafted k: its cells lead the [B, K] output buffers
        if (on_device or sampled) and not whole:  # the rows' cells of the [B, K] output buffers
            index = torch.tensor([b * K + j for b, k in enumerate(ks) for j in range(k)], dtype=torch.int64)
            index = upload(index, self.device)
        if on_device:  # copied: the buffers are drafted into again while the verifier may still read these
            token_ids = self._tokens[:len(ks)].flatten().clone() if whole else (
                self._tokens.flatten().index_select(0, index))
        else:
            rows = read_back(self._tokens[:len(ks)]).tolist()  # the wait for the drafts, and their one copy
            token_ids = torch.tensor([t for row, k in zip(rows, ks, strict=True) for t in row[:k]],
                                     dtype=torch.int64)
        num_drafts = torch.tensor(ks, dtype=torch.int32)
        if not sampled:
            return Proposal(token_ids, num_drafts, None)
        to_target = self.head.draft_to_target
        if whole:  # copies, as index_select makes: the q may be read after the next drafting
            top_idx = self._top_idx[:len(ks)].flatten(0, 1).clone()
            top_q = self._top_q[:len(ks)].flatten(0, 1).clone()
            index = torch.arange(len(ks) * K, device=self.device)  # for the dense q below
        else:
            top_idx = self._top_idx.flatten(0, 1).index_select(0, index)
            top_q = self._top_q.flatten(0, 1).index_select(0, index)
        if to_target is not None:
            top_idx = to_target[top_idx]
        if all(tk > 0 for _, tk in sampled):
            width = max(tk for _, tk in sampled)
            top_idx, top_q = top_idx[:, :width], top_q[:, :width]
            unused = torch.where(top_q > 0, top_idx, -1)  # -1 marks an unused slot of a shorter row
            return Proposal(token_ids, num_drafts, DraftProbs.sparse(unused, top_q))
        # Some sampled row drafts from the full vocabulary: dense q, truncated rows scattered in.
        row_full = upload(torch.tensor(
            [t > 0 and tk == 0 for t, tk, k in zip(temperature, top_k, ks, strict=True) for _ in range(k)]
        ), self.device)
        full_q = self._full_q.flatten(0, 1).index_select(0, index)
        vocab = self.head.config.target_vocab_size
        if to_target is not None:
            full_q = torch.zeros(len(index), vocab, device=self.device).index_copy_(1, to_target, full_q)
        scattered = torch.zeros(len(index), vocab, device=self.device).scatter_(1, top_idx, top_q)
        return Proposal(
            token_ids, num_drafts, DraftProbs.dense(torch.where(row_full[:, None], full_q, scattered))
        )
