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

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from specwire.drafter.draft_sampling import sample_drafts
from specwire.drafter.eagle_head import EagleHead
from specwire.kernels.rejection_sampler import DraftProbs

from specwire.engine import capture, on_own_device
from specwire.model import KVCache


class ProposerError(ValueError):
    """Bad input to the proposer (unknown request, wrong shapes, out of capacity)."""


class Proposal(NamedTuple):
    token_ids: torch.Tensor  # [sum k_b] int64 (target ids), rows in the order of propose's request_ids
    num_drafts: torch.Tensor  # [B] int32 on the CPU; below the asked k near the end of the context
    probs: DraftProbs | None  # None when every row is greedy; sparse when every sampled row is top-K


@dataclass
class _Request:
    slot: int
    num_cached: int = 0  # pairs whose K/V are committed in the head's cache
    pending_tokens: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)

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
    ):
        """cuda_graphs=False forces eager execution on CUDA; CPU always runs eagerly."""
        if max_drafts < 1:
            raise ProposerError(f"max_drafts must be >= 1, got {max_drafts}")
        if not 1 <= max_top_k <= head.vocab_size:
            raise ProposerError(f"max_top_k must be in [1, {head.vocab_size}], got {max_top_k}")
        self.head, self.device = head, head.device
        self.max_requests, self.max_context, self.max_drafts = max_requests, max_context, max_drafts
        self.max_top_k = max_top_k
        self.cache = KVCache.allocate(head.config.layer, max_requests, max_context, head.dtype, self.device)
        self.requests: dict[str, _Request] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))

        n, T, K, dev = max_requests, max_drafts + 1, max_drafts, self.device
        self._T = T
        self._meta = torch.zeros(5, n, dtype=torch.int32, device=dev)
        self._temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self._input_ids = torch.zeros(n, T, dtype=torch.int64, device=dev)
        self._features = torch.zeros(n, T, head.config.feature_dim, dtype=head.dtype, device=dev)
        # Outputs, written by every (replayed) run: the proposer's own float32 buffers.
        self._tokens = torch.zeros(n, K, dtype=torch.int64, device=dev)
        self._top_idx = torch.zeros(n, K, max_top_k, dtype=torch.int64, device=dev)
        self._top_q = torch.zeros(n, K, max_top_k, dtype=torch.float32, device=dev)
        self._full_q = torch.zeros(n, K, head.vocab_size, dtype=torch.float32, device=dev)
        self._meta[self._SLOT] = self.cache.trash_slot

        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.graph_sizes = graph_batch_sizes(max_requests) if cuda_graphs and dev.type == "cuda" else []
        if self.graph_sizes:
            self._capture()

    # ------------------------------------------------------------------------------------ requests

    @on_own_device
    def add(self, request_id: str, token_ids: list[int], features: torch.Tensor) -> None:
        """A new request: its tokens so far (prompt + first sampled token) and the target features of all
        but the last token ([len(token_ids) - 1, feature_dim])."""
        if request_id in self.requests:
            raise ProposerError(f"request {request_id!r} already exists")
        if not self._free_slots:
            raise ProposerError(f"all {self.max_requests} drafter slots are in use")
        if len(token_ids) < 2:
            raise ProposerError(f"request {request_id!r} needs at least 2 tokens, got {len(token_ids)}")
        request = _Request(self._free_slots[-1])
        self._append(request_id, request, token_ids[1:], features)
        self.requests[request_id] = request
        self._free_slots.pop()

    @on_own_device
    def update(self, request_id: str, accepted_token_ids: list[int], features: torch.Tensor) -> None:
        """After verification: the request's new tokens and the target features of the positions before
        each of them (the verified [last token, accepted drafts]): one feature per new token."""
        self._append(request_id, self._get(request_id), accepted_token_ids, features)

    def free(self, request_id: str) -> None:
        self._free_slots.append(self._get(request_id).slot)
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
        # Kept on the host until propose(), which sends every request's pending features over in one copy.
        request.pending_features.append(features.to("cpu", self.head.dtype))

    # ------------------------------------------------------------------------------------ propose

    @torch.no_grad()
    @on_own_device
    def propose(
        self,
        request_ids: list[str],
        num_drafts: list[int],
        temperature: list[float],
        top_k: list[int],
    ) -> Proposal:
        """Draft num_drafts[b] tokens (0..max_drafts) for each request; temperature 0 drafts greedily, else
        samples from softmax(logits / T) truncated to the top_k[b] logits (0 = the full vocabulary)."""
        B = len(request_ids)
        if not len(num_drafts) == len(temperature) == len(top_k) == B:
            raise ProposerError(
                "request_ids, num_drafts, temperature and top_k must have one entry per request"
            )
        if len(set(request_ids)) != B:
            raise ProposerError("request_ids has duplicates")
        requests = [self._get(r) for r in request_ids]
        for rid, req, k, t, tk in zip(request_ids, requests, num_drafts, temperature, top_k, strict=True):
            if not 0 <= k <= self.max_drafts:
                raise ProposerError(f"num_drafts {k} for {rid!r} out of range [0, {self.max_drafts}]")
            if not t >= 0:
                raise ProposerError(f"temperature {t} for {rid!r} must be >= 0")
            if not 0 <= tk <= self.max_top_k:
                raise ProposerError(f"top_k {tk} for {rid!r} out of range [0, {self.max_top_k}]")
            if k > 0 and req.num_pending == 0:
                raise ProposerError(f"request {rid!r} has no new tokens since its last proposal")
        if B == 0:
            return self._empty_proposal()

        self._prefill_overflow(requests)
        # Drafts write positions num_cached + pending .. + k - 2: clip k at the end of the context.
        ks = [
            min(k, self.max_context - r.num_cached - r.num_pending + 1)
            for r, k in zip(requests, num_drafts, strict=True)
        ]
        size = next((s for s in self.graph_sizes if s >= B), B)
        self._load_batch(requests, ks, temperature, top_k, size)
        sampled = [tk for t, tk, k in zip(temperature, top_k, ks, strict=True) if t > 0 and k > 0]
        mode = "greedy" if not sampled else "top_k" if all(sampled) else "full"
        if (size, mode) in self.graphs:
            self.graphs[size, mode].replay()
        else:
            self._draft_loop(size, mode)
        for r in requests:
            r.num_cached += r.num_pending
            r.pending_tokens, r.pending_features = [], []
        return self._proposal(ks, temperature, top_k)

    def _prefill_overflow(self, requests: list[_Request]) -> None:
        """Eagerly commit pending pairs beyond the graph's first-step width (new prompts), keeping one."""
        rows = [r for r in requests if r.num_pending > self._T]
        if not rows:
            return
        counts = [r.num_pending - 1 for r in rows]
        width = max(counts)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        feats = torch.zeros(len(rows), width, self.head.config.feature_dim, dtype=self.head.dtype)
        for i, (r, n) in enumerate(zip(rows, counts, strict=True)):
            ids[i, :n] = torch.tensor(r.pending_tokens[:n])
            feats[i, :n] = torch.cat(r.pending_features)[:n]

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        self.head(
            ids.to(self.device),
            feats.to(self.device),
            column([r.num_cached for r in rows]),
            column(counts),
            column([r.slot for r in rows]),
            self.cache.k[0],
            self.cache.v[0],
        )
        for r, n in zip(rows, counts, strict=True):
            rest = torch.cat(r.pending_features)[n:]
            r.num_cached += n
            r.pending_tokens, r.pending_features = r.pending_tokens[n:], [rest]

    def _load_batch(
        self, requests: list[_Request], ks: list[int], temperature: list[float], top_k: list[int], size: int
    ) -> None:
        """Rewrite every input buffer of rows [0, size): live rows from the requests, the rest as padding.
        Built on the host, then one non-blocking copy per buffer (the pending features of all rows in one)."""
        T, pad = self._T, size - len(requests)
        meta = torch.tensor([
            [r.slot for r in requests] + [self.cache.trash_slot] * pad,
            [r.num_cached for r in requests] + [0] * pad,
            [r.num_pending for r in requests] + [0] * pad,
            [*ks, *[0] * pad],
            [*top_k, *[0] * pad],
        ], dtype=torch.int32)
        ids = torch.tensor([r.pending_tokens + [0] * (T - r.num_pending) for r in requests] + [[0] * T] * pad,
                           dtype=torch.int64)
        temps = torch.tensor([*temperature, *[0.0] * pad], dtype=torch.float32)
        self._meta[:, :size].copy_(meta, non_blocking=True)
        self._temperature[:size].copy_(temps, non_blocking=True)
        self._input_ids[:size].copy_(ids, non_blocking=True)
        flat_rows = [b * T + i for b, r in enumerate(requests) for i in range(r.num_pending)]
        if flat_rows:
            feats = torch.cat([f for r in requests for f in r.pending_features])
            feats = feats.to(self.device, non_blocking=True)
            index = torch.tensor(flat_rows).to(self.device, non_blocking=True)
            self._features.view(-1, self._features.shape[-1]).index_copy_(0, index, feats)

    def _draft_loop(self, size: int, mode: str) -> None:
        """The graph body: first step over the pending pairs, then max_drafts - 1 single-token steps.

        Per-step metadata comes from the per-row block: step j feeds position start + pending + j - 1, one
        token while j < k (else 0 tokens: nothing is written to a live slot).
        """
        head, meta = self.head, self._meta[:, :size]
        slots, start, pending, drafts, top_k = (meta[i] for i in range(5))
        kc, vc = self.cache.k[0], self.cache.v[0]
        T = self._T
        out = head(self._input_ids[:size], self._features[:size], start, pending, slots, kc, vc)
        last = torch.arange(size, device=self.device) * T + (pending.long() - 1).clamp_min(0)
        hidden = out.flatten(0, 1).index_select(0, last)  # pad rows gather index 0*T + 0
        position = start + pending
        for j in range(self.max_drafts):
            sample = sample_drafts(head.logits(hidden), self._temperature[:size], top_k, self.max_top_k, mode)
            tokens = sample.tokens if head.draft_to_target is None else head.draft_to_target[sample.tokens]
            self._tokens[:size, j].copy_(tokens)
            if sample.top_q is not None:
                self._top_idx[:size, j].copy_(sample.top_idx)
                self._top_q[:size, j].copy_(sample.top_q)
            if sample.full_q is not None:
                self._full_q[:size, j].copy_(sample.full_q)
            if j + 1 == self.max_drafts:
                break
            live = (drafts > j + 1).int()
            hidden = head(tokens[:, None], hidden[:, None], position, live, slots, kc, vc, own_features=True)[
                :, 0
            ]
            position = position + 1

    @on_own_device
    def _capture(self) -> None:
        """One graph per (padded batch size, sampling mode); all share one memory pool."""
        pool = None
        for mode in ("greedy", "top_k", "full"):
            self._draft_loop(self.graph_sizes[-1], mode)  # warm-up: compiles the Triton kernels; rows padding
            torch.cuda.synchronize()
            for size in reversed(self.graph_sizes):  # largest first, so smaller graphs reuse its memory
                graph = torch.cuda.CUDAGraph()
                with capture(graph, pool):
                    self._draft_loop(size, mode)
                pool = graph.pool()
                self.graphs[size, mode] = graph
        torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------ outputs

    def _empty_proposal(self) -> Proposal:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return Proposal(empty, torch.zeros(0, dtype=torch.int32), None)

    def _proposal(self, ks: list[int], temperature: list[float], top_k: list[int]) -> Proposal:
        """Pack rows [b, :k_b] of the output buffers; choose the smallest exact q payload."""
        K = self.max_drafts
        index = torch.tensor([b * K + j for b, k in enumerate(ks) for j in range(k)], dtype=torch.int64)
        index = index.to(self.device, non_blocking=True)
        token_ids = self._tokens.view(-1).index_select(0, index)
        num_drafts = torch.tensor(ks, dtype=torch.int32)
        sampled = [(t, tk) for t, tk, k in zip(temperature, top_k, ks, strict=True) if t > 0 and k > 0]
        if not sampled:
            return Proposal(token_ids, num_drafts, None)
        to_target = self.head.draft_to_target
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
        row_full = torch.tensor(
            [t > 0 and tk == 0 for t, tk, k in zip(temperature, top_k, ks, strict=True) for _ in range(k)]
        ).to(self.device, non_blocking=True)
        full_q = self._full_q.flatten(0, 1).index_select(0, index)
        vocab = self.head.config.target_vocab_size
        if to_target is not None:
            full_q = torch.zeros(len(index), vocab, device=self.device).index_copy_(1, to_target, full_q)
        scattered = torch.zeros(len(index), vocab, device=self.device).scatter_(1, top_idx, top_q)
        return Proposal(
            token_ids, num_drafts, DraftProbs.dense(torch.where(row_full[:, None], full_q, scattered))
        )
