"""Drafter proposals -> the verifier's batch, matched by request id and checked before they reach the sampler.

The drafter answers in its own order, may skip requests, and is not trusted: every proposal is decoded with
specwire.wire and checked (draft count, token ids, probability kind, shape, dtype, vocabulary, NaN, row sums,
the draft lying in q's support). A bad proposal costs that request its drafts for the step, never a shifted
row or a wrong distribution. Rows follow the verifier's batch: requests [a, b, c] with proposals {c: 1, a: 2}
give draft rows [a[:2], c[:1]] and num_drafts [2, 0, 1] (a request without a proposal gets 0 drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from specwire.kernels.rejection_sampler import DraftProbs

from specwire.v1 import drafter_pb2 as pb
from specwire.wire import WireError, decode_tensor

# A probability row must sum to 1 within this (float32 softmax over 49k entries sums to 1 +- 1e-5).
ROW_SUM_TOLERANCE = 1e-3


class ProposalError(ValueError):
    """One proposal is malformed; the message names the request and the bad value."""


@dataclass(frozen=True)
class Want:
    """What the verifier asked for one request in one step."""

    num_drafts: int
    temperature: float  # 0 = greedy drafts, no probabilities
    top_k: int  # with temperature > 0: 0 = dense q, else sparse top-K q


@dataclass(frozen=True)
class Drafts:
    """One request's checked drafts and the q they were drawn from (CPU tensors)."""

    token_ids: list[int]
    indices: torch.Tensor | None = None  # sparse q: [k, K] int64, -1 = unused slot
    values: torch.Tensor | None = None  # sparse q: [k, K] float32
    probs: torch.Tensor | None = None  # dense q: [k, V] float32


@dataclass
class AlignedResult:
    """One DraftResult, checked: drafts per request id, and what was thrown away."""

    drafts: dict[str, Drafts] = field(default_factory=dict)
    unknown_ids: list[str] = field(default_factory=list)  # proposals for requests not wanted in that step
    invalid: dict[str, str] = field(default_factory=dict)  # request id -> why its proposal was rejected


@dataclass(frozen=True)
class BatchDrafts:
    """Drafts in the verifier's batch order, ready for rejection_sample."""

    token_ids: list[list[int]]  # per batch row, possibly empty
    probs: DraftProbs | None  # rows concatenated; None = every draft is one-hot (greedy)

    @property
    def num_drafts(self) -> list[int]:
        return [len(t) for t in self.token_ids]


def read_result(result: pb.DraftResult, wants: dict[str, Want], vocab_size: int) -> AlignedResult:
    """Check every proposal of `result` against what `wants` asked for."""
    aligned = AlignedResult()
    for proposal in result.proposals:
        rid = proposal.request_id
        want = wants.get(rid)
        if want is None or rid in aligned.drafts or rid in aligned.invalid:
            aligned.unknown_ids.append(rid)  # never asked for, or a duplicate: ignored
            continue
        try:
            aligned.drafts[rid] = decode_proposal(proposal, want, vocab_size)
        except ProposalError as e:
            aligned.invalid[rid] = str(e)
    return aligned


def decode_proposal(proposal: pb.Proposal, want: Want, vocab_size: int) -> Drafts:
    rid = proposal.request_id
    ids = list(proposal.draft_token_ids)
    if len(ids) > want.num_drafts:
        raise ProposalError(f"proposal {rid!r}: {len(ids)} drafts, but {want.num_drafts} were asked for")
    if bad := [t for t in ids if t >= vocab_size]:
        raise ProposalError(f"proposal {rid!r}: draft token id {bad[0]} out of range [0, {vocab_size})")
    if not ids:
        return Drafts([])
    kind = proposal.probs_kind
    expected = (pb.PROBS_KIND_NONE if want.temperature == 0
                else pb.PROBS_KIND_SPARSE if want.top_k > 0 else pb.PROBS_KIND_DENSE)
    # A sparse request may be answered densely (exact too); anything else mixes up q.
    if kind != expected and not (expected == pb.PROBS_KIND_SPARSE and kind == pb.PROBS_KIND_DENSE):
        name = pb.ProbsKind.Name(kind) if kind in pb.ProbsKind.values() else f"{kind} (not a ProbsKind)"
        raise ProposalError(f"proposal {rid!r}: probs_kind {name}, expected {pb.ProbsKind.Name(expected)}")
    if kind == pb.PROBS_KIND_NONE:
        return Drafts(ids)
    drafted = torch.tensor(ids, dtype=torch.int64)
    try:
        if kind == pb.PROBS_KIND_DENSE:
            probs = decode_tensor(proposal.probs, dtypes=(torch.float32,), ndim=2,
                                  name=f"proposal {rid!r} probs")
            _check_shape(rid, "probs", probs, (len(ids), vocab_size))
            _check_distribution(rid, probs, probs.gather(1, drafted[:, None]))
            return Drafts(ids, probs=probs)
        limit = len(ids) * vocab_size
        indices = decode_tensor(proposal.sparse.indices, dtypes=(torch.int32, torch.int64), ndim=2,
                                max_elements=limit, name=f"proposal {rid!r} sparse indices").long()
        values = decode_tensor(proposal.sparse.values, dtypes=(torch.float32,), ndim=2, max_elements=limit,
                               name=f"proposal {rid!r} sparse values")
    except WireError as e:
        raise ProposalError(str(e)) from None
    K = indices.shape[1]
    _check_shape(rid, "sparse indices", indices, (len(ids), K))
    _check_shape(rid, "sparse values", values, (len(ids), K))
    if not 1 <= K <= min(want.top_k, vocab_size):
        raise ProposalError(f"proposal {rid!r}: sparse width {K}, expected 1..{want.top_k}")
    unused = indices == -1
    if bool(((indices < -1) | (indices >= vocab_size)).any()):
        raise ProposalError(f"proposal {rid!r}: sparse index out of range [0, {vocab_size})")
    if bool((unused & (values != 0)).any()):
        raise ProposalError(f"proposal {rid!r}: unused sparse slot (-1) with nonzero probability")
    ordered = torch.where(unused, -1 - torch.arange(K), indices).sort(1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ProposalError(f"proposal {rid!r}: repeated token in a sparse row")
    _check_distribution(rid, values, ((indices == drafted[:, None]) * values).sum(1, keepdim=True))
    return Drafts(ids, indices=indices, values=values)


def _check_shape(rid: str, name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ProposalError(f"proposal {rid!r}: {name} of shape {list(tensor.shape)}, expected {list(shape)}")


def _check_distribution(rid: str, q: torch.Tensor, q_of_draft: torch.Tensor) -> None:
    """q rows are finite, non-negative, sum to 1, and give each draft a positive probability."""
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise ProposalError(f"proposal {rid!r}: probabilities contain NaN, inf or negative values")
    sums = q.double().sum(1)
    if bool(((sums - 1).abs() > ROW_SUM_TOLERANCE).any()):
        raise ProposalError(f"proposal {rid!r}: probability rows sum to {sums.tolist()}, not 1")
    if bool((q_of_draft <= 0).any()):
        raise ProposalError(f"proposal {rid!r}: a draft token has probability 0 under its own q")


def batch_drafts(request_ids: list[str], drafts: dict[str, Drafts], vocab_size: int) -> BatchDrafts:
    """Rows in the order of `request_ids` (missing = 0 drafts), q merged into one DraftProbs.

    Greedy drafts have one-hot q. If no row ships q, the result is None (all one-hot); if any row is dense,
    every row becomes a dense [V] row; else every row becomes a sparse row padded with -1.
    """
    rows = [drafts.get(rid) or Drafts([]) for rid in request_ids]
    token_ids = [d.token_ids for d in rows]
    shipped = [d for d in rows if d.token_ids and (d.probs is not None or d.values is not None)]
    if not shipped:
        return BatchDrafts(token_ids, None)
    D = sum(len(t) for t in token_ids)
    if any(d.probs is not None for d in shipped):
        probs = torch.zeros(D, vocab_size, dtype=torch.float32)
        start = 0
        for d in rows:
            k, end = len(d.token_ids), start + len(d.token_ids)
            if d.probs is not None:
                probs[start:end] = d.probs
            elif d.values is not None:
                # scatter_add: unused slots (-1 -> column 0) add 0 instead of overwriting column 0
                used = torch.where(d.indices >= 0, d.values, 0.0)
                probs[start:end].scatter_add_(1, d.indices.clamp_min(0), used)
            elif k:
                probs[torch.arange(start, end), torch.tensor(d.token_ids)] = 1.0
            start = end
        return BatchDrafts(token_ids, DraftProbs.dense(probs))
    K = max(d.values.shape[1] for d in shipped)
    indices = torch.full((D, K), -1, dtype=torch.int64)
    values = torch.zeros(D, K, dtype=torch.float32)
    start = 0
    for d in rows:
        end = start + len(d.token_ids)
        if d.values is not None:
            indices[start:end, :d.values.shape[1]] = d.indices
            values[start:end, :d.values.shape[1]] = d.values
        elif end > start:
            indices[start:end, 0] = torch.tensor(d.token_ids)
            values[start:end, 0] = 1.0
        start = end
    return BatchDrafts(token_ids, DraftProbs.sparse(indices, values))


@dataclass
class Table:
    """One request's speculation-cache table: per outcome (accepted drafts, bonus token), the branch index and
    the Proposal as it came. Only the entry the realised outcome picks reaches the sampler, so only its drafts
    are decoded and checked (`pick`): a table of 8 branches at batch 64 is 512 proposals, and checking them
    all took most of the verifier's host time between two verifications."""

    want: Want | None = None
    entries: dict[tuple[int, int], tuple[int, pb.Proposal]] = field(default_factory=dict)

    def pick(self, outcome: tuple[int, int], vocab_size: int) -> tuple[int, Drafts] | None:
        """(branch index, checked drafts) of the entry for `outcome`, or None; raises ProposalError."""
        entry = self.entries.get(outcome)
        if entry is None:
            return None
        index, proposal = entry
        return index, decode_proposal(proposal, self.want, vocab_size)


def read_tables(result: pb.DraftResult, wants: dict[str, tuple[Want, int, int]], vocab_size: int
                ) -> tuple[dict[str, Table], AlignedResult]:
    """Reads every table entry of `result`. wants: request id -> (its want, the most branches asked for,
    the drafts its verification in flight checks). An entry must name an outcome once, with a bonus token in
    the vocabulary; a bad entry is dropped alone (its drafts are checked when it is picked). Entries for more
    accepted drafts than are checked (the verifier cut them short) are skipped."""
    tables: dict[str, Table] = {}
    aligned = AlignedResult()
    for proposal in result.proposals:
        rid = proposal.request_id
        if rid not in wants or not proposal.HasField("branch"):
            aligned.unknown_ids.append(rid)
            continue
        want, most, checked = wants[rid]
        table = tables.setdefault(rid, Table(want))
        branch = proposal.branch
        outcome = (branch.accepted, branch.bonus_token_id)
        try:
            if len(table.entries) >= most:
                raise ProposalError(f"proposal {rid!r}: more than the {most} branches asked for")
            if branch.bonus_token_id >= vocab_size:
                raise ProposalError(f"proposal {rid!r}: bonus token id {branch.bonus_token_id} out of range "
                                    f"[0, {vocab_size})")
            if branch.accepted > checked:  # the verifier cut the drafts short (room): it cannot happen
                continue
            if outcome in table.entries:
                raise ProposalError(f"proposal {rid!r}: a second branch for outcome {outcome}")
            table.entries[outcome] = (branch.index, proposal)
        except ProposalError as e:
            aligned.invalid[rid] = str(e)
    return tables, aligned
