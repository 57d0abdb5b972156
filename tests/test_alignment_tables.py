"""Speculation-cache tables as the verifier reads them (alignment.read_tables): entries by outcome, bad
entries dropped alone, and a picked entry's drafts checked like any proposal before they reach the sampler."""

import pytest
import torch
from specwire.verifier.alignment import ProposalError, Want, read_tables

from specwire.v1 import drafter_pb2 as pb
from specwire.wire import encode_tensor

VOCAB = 100
SAMPLED = Want(num_drafts=2, temperature=1.0, top_k=4)


def entry(result: pb.DraftResult, rid: str, accepted: int, bonus: int, drafts: list[int],
          values: torch.Tensor | None = None) -> None:
    p = result.proposals.add(request_id=rid, draft_token_ids=drafts)
    p.branch.index, p.branch.accepted, p.branch.bonus_token_id = len(result.proposals) - 1, accepted, bonus
    p.probs_kind = pb.PROBS_KIND_SPARSE
    indices = torch.tensor([[d, (d + 1) % VOCAB, -1, -1] for d in drafts], dtype=torch.int32)
    if values is None:
        values = torch.tensor([[0.75, 0.25, 0.0, 0.0]] * len(drafts))
    p.sparse.indices.CopyFrom(encode_tensor(indices))
    p.sparse.values.CopyFrom(encode_tensor(values))


def test_entries_are_found_by_outcome_and_a_picked_entry_is_checked():
    result = pb.DraftResult()
    entry(result, "a", 0, 5, [7, 8])
    entry(result, "a", 1, 9, [3, 4], values=torch.tensor([[float("nan"), 0.25, 0.0, 0.0]] * 2))
    tables, aligned = read_tables(result, {"a": (SAMPLED, 8, 2)}, VOCAB)
    assert not aligned.invalid and set(tables["a"].entries) == {(0, 5), (1, 9)}
    index, drafts = tables["a"].pick((0, 5), VOCAB)
    assert index == 0 and drafts.token_ids == [7, 8]
    assert drafts.indices.tolist() == [[7, 8, -1, -1], [8, 9, -1, -1]]
    assert drafts.values.tolist() == [[0.75, 0.25, 0.0, 0.0]] * 2
    assert tables["a"].pick((2, 5), VOCAB) is None  # not in the table: a miss
    with pytest.raises(ProposalError, match="NaN"):  # a bad entry never reaches the sampler
        tables["a"].pick((1, 9), VOCAB)


def test_a_bad_entry_is_dropped_alone():
    result = pb.DraftResult()
    entry(result, "a", 0, 5, [7, 8])
    entry(result, "a", 0, 5, [1, 2])  # the same outcome twice
    entry(result, "a", 0, VOCAB + 3, [1, 2])  # bonus out of the vocabulary
    entry(result, "a", 2, 6, [1])  # more accepted drafts than the verification in flight checks: skipped
    entry(result, "nobody", 0, 5, [1])
    tables, aligned = read_tables(result, {"a": (SAMPLED, 8, 1)}, VOCAB)
    assert set(tables["a"].entries) == {(0, 5)} and tables["a"].pick((0, 5), VOCAB)[1].token_ids == [7, 8]
    assert "out of range" in aligned.invalid["a"] and aligned.unknown_ids == ["nobody"]


def test_a_table_larger_than_asked_for_is_cut():
    result = pb.DraftResult()
    for bonus in range(3):
        entry(result, "a", 0, bonus, [7])
    tables, aligned = read_tables(result, {"a": (SAMPLED, 2, 2)}, VOCAB)
    assert set(tables["a"].entries) == {(0, 0), (0, 1)} and "more than the 2 branches" in aligned.invalid["a"]
