"""Drafter proposals -> the verifier's batch, matched by request id and checked before they reach the sampler.

The drafter answers in its own order, may skip requests, and is not trusted: every proposal is decoded with
specwire.wire and checked (draft count, token ids, probability kind, shape, dtype, vocabulary, NaN, row sums,
the draft lying in q's support). A bad proposal costs that request its drafts for the step, never a shifted
row or a wrong distribution. Rows follow the verifier's batch: requests [a, b, c] with proposals {c: 1, a: 2}
give draft rows [a[:2], c[:1]] and num_drafts [2, 0, 1] (a request without a proposal gets 0 drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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

    token_ids: list[list[int]]  # per batch row, possibly empty; zeros where on_device holds the drafts
    probs: DraftProbs | None  # rows concatenated; None = every draft is one-hot (greedy)
    # Drafts left where a co-located drafter made them, every row's concatenated (their q, if any, in probs
    # on its device too): fed to the verification as they are, never read by the host (token_ids then only
    # say how many each row has).
    on_device: torch.Tensor | None = None

    @property
    def num_drafts(self) -> list[int]:
        return [len(t) for t in self.token_ids]


def read_result(result: pb.DraftResult, wants: dict[str, Want], vocab_size: int) -> AlignedResult:
    """Check every proposal of `result` against what `wants` asked for. The sparse q of all proposals are
    checked together (_check_sparse_batch): one pass of numpy over every row instead of one per proposal."""
    aligned = AlignedResult()
    for proposal in result.proposals:
        rid = proposal.request_id
        want = wants.get(rid)
        if want is None or rid in aligned.drafts or rid in aligned.invalid:
            aligned.unknown_ids.append(rid)  # never asked for, or a duplicate: ignored
            continue
        try:
            aligned.drafts[rid] = decode_proposal(proposal, want, vocab_size, check_sparse=False)
        except ProposalError as e:
            aligned.invalid[rid] = str(e)
    _check_sparse_batch(aligned, vocab_size)
    return aligned


def decode_proposal(proposal: pb.Proposal, want: Want, vocab_size: int, check_sparse: bool = True) -> Drafts:
    """One proposal decoded and checked; check_sparse=False leaves a sparse q's values to the caller
    (read_result checks a whole result's at once)."""
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
    try:
        if kind == pb.PROBS_KIND_DENSE:
            probs = decode_tensor(proposal.probs, dtypes=(torch.float32,), ndim=2,
                                  name=f"proposal {rid!r} probs")
            _check_shape(rid, "probs", probs, (len(ids), vocab_size))
            q = probs.numpy()
            _raise_first(rid, q, _distribution_faults(q, q[np.arange(len(ids)), ids]))
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
    drafts = Drafts(ids, indices=indices, values=values)
    if check_sparse:
        _raise_first(rid, values.numpy(), _sparse_faults(indices.numpy(), values.numpy(), ids, vocab_size),
                     vocab_size)
    return drafts


def _check_shape(rid: str, name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ProposalError(f"proposal {rid!r}: {name} of shape {list(tensor.shape)}, expected {list(shape)}")


# What is wrong with a q row, in the order checked (0: nothing). The checks run in numpy over many rows at
# once: a dozen torch calls on tiny CPU tensors a proposal took 2.6-4.5 ms a batch-16 step on the 2-core CPU,
# against 0.9 ms now (bench/bench_sampled_q_host.py).
_FAULTS = {
    1: "sparse index out of range [0, {vocab})",
    2: "unused sparse slot (-1) with nonzero probability",
    3: "repeated token in a sparse row",
    4: "probabilities contain NaN, inf or negative values",
    5: "probability rows sum to {sums}, not 1",
    6: "a draft token has probability 0 under its own q",
}


def _distribution_faults(q: np.ndarray, q_of_draft: np.ndarray) -> np.ndarray:
    """Per row: 4 unless finite and non-negative, else 5 unless it sums to 1, else 6 unless the draft has a
    positive probability, else 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        off = np.abs(q.sum(1, dtype=np.float64) - 1) > ROW_SUM_TOLERANCE
    return np.select([~np.isfinite(q).all(1) | (q < 0).any(1), off, q_of_draft <= 0], [4, 5, 6], 0)


def _sparse_faults(indices: np.ndarray, values: np.ndarray, drafted: list[int] | np.ndarray, vocab_size: int
                   ) -> np.ndarray:
    """Per sparse row [K] (slot -1: unused): the first fault of _FAULTS, or 0."""
    unused = indices == -1
    ordered = np.sort(np.where(unused, -1 - np.arange(indices.shape[1]), indices), axis=1)
    q_of_draft = np.where(indices == np.asarray(drafted)[:, None], values, 0).sum(1)
    structure = np.select([((indices < -1) | (indices >= vocab_size)).any(1), (unused & (values != 0)).any(1),
                           (ordered[:, 1:] == ordered[:, :-1]).any(1)], [1, 2, 3], 0)
    return np.where(structure > 0, structure, _distribution_faults(values, q_of_draft))


def _raise_first(rid: str, q: np.ndarray, faults: np.ndarray, vocab_size: int = 0) -> None:
    """Raises ProposalError for the first faulty row, if any."""
    if faults.any():
        fault = int(faults[faults > 0][0])
        sums = q.sum(1, dtype=np.float64).tolist()
        raise ProposalError(f"proposal {rid!r}: " + _FAULTS[fault].format(vocab=vocab_size, sums=sums))


def _check_sparse_batch(aligned: AlignedResult, vocab_size: int) -> None:
    """Checks every sparse q of `aligned` in one pass (rows padded to the widest with unused slots); a
    proposal with a faulty row moves to `invalid`, named by its first fault."""
    sparse = [(rid, d) for rid, d in aligned.drafts.items() if d.values is not None]
    if not sparse:
        return
    K = max(d.values.shape[1] for _, d in sparse)
    rows = sum(len(d.token_ids) for _, d in sparse)
    indices, values = np.full((rows, K), -1, dtype=np.int64), np.zeros((rows, K), dtype=np.float32)
    drafted, owner, start = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64), 0
    for i, (_, d) in enumerate(sparse):
        end, width = start + len(d.token_ids), d.values.shape[1]
        indices[start:end, :width], values[start:end, :width] = d.indices.numpy(), d.values.numpy()
        drafted[start:end], owner[start:end], start = d.token_ids, i, end
    faults = _sparse_faults(indices, values, drafted, vocab_size)
    for i in np.unique(owner[faults > 0]).tolist():
        rid, d = sparse[i]
        del aligned.drafts[rid]
        try:
            _raise_first(rid, d.values.numpy(), faults[owner == i], vocab_size)
        except ProposalError as e:
            aligned.invalid[rid] = str(e)


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
