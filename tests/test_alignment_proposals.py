"""A serial step's proposals as the verifier reads them (alignment.read_result): the sparse q of the whole
result are checked in one pass, yet each fault costs only its own request, named as when a proposal is
checked alone (a picked table entry: decode_proposal)."""

import pytest
import torch
from specwire.verifier.alignment import ProposalError, Want, decode_proposal, read_result

from specwire.v1 import drafter_pb2 as pb
from specwire.wire import encode_tensor

VOCAB = 100
GOOD_INDICES = [[7, 8, -1, -1], [3, 4, 5, -1]]
GOOD_VALUES = [[0.75, 0.25, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0]]

# request id -> (indices, values, drafts, the message), one fault of each kind
FAULTY = {
    "range": ([[7, 100, -1, -1], GOOD_INDICES[1]], GOOD_VALUES, [7, 3], "sparse index out of range"),
    "unused": (GOOD_INDICES, [[0.75, 0.2, 0.05, 0.0], GOOD_VALUES[1]], [7, 3], "unused sparse slot"),
    "repeat": ([[7, 7, -1, -1], GOOD_INDICES[1]], GOOD_VALUES, [7, 3], "repeated token"),
    "nan": (GOOD_INDICES, [GOOD_VALUES[0], [float("nan"), 0.5, 0.5, 0.0]], [7, 3], "NaN, inf or negative"),
    "negative": (GOOD_INDICES, [[1.25, -0.25, 0.0, 0.0], GOOD_VALUES[1]], [7, 3], "NaN, inf or negative"),
    "sum": (GOOD_INDICES, [[0.5, 0.25, 0.0, 0.0], GOOD_VALUES[1]], [7, 3], r"sum to \[0.75, 1.0\], not 1"),
    "zero": (GOOD_INDICES, GOOD_VALUES, [9, 3], "a draft token has probability 0"),  # 9 is not in row 0
}


def add(result: pb.DraftResult, rid: str, indices: list, values: list, drafts: list[int]) -> pb.Proposal:
    p = result.proposals.add(request_id=rid, draft_token_ids=drafts)
    p.probs_kind = pb.PROBS_KIND_SPARSE
    p.sparse.indices.CopyFrom(encode_tensor(torch.tensor(indices, dtype=torch.int32)))
    p.sparse.values.CopyFrom(encode_tensor(torch.tensor(values, dtype=torch.float32)))
    return p


def test_each_faulty_q_costs_only_its_request_named_as_when_checked_alone():
    result = pb.DraftResult()
    add(result, "good", GOOD_INDICES, GOOD_VALUES, [7, 3])
    add(result, "narrow", [[7], [3]], [[1.0], [1.0]], [7, 3])  # a narrower row: padded in the joint check
    for rid, (indices, values, drafts, _) in FAULTY.items():
        add(result, rid, indices, values, drafts)
    want = Want(num_drafts=2, temperature=1.0, top_k=4)
    aligned = read_result(result, {p.request_id: want for p in result.proposals}, VOCAB)
    assert set(aligned.drafts) == {"good", "narrow"}
    assert aligned.drafts["good"].values.tolist() == GOOD_VALUES
    assert aligned.drafts["narrow"].indices.tolist() == [[7], [3]]
    assert set(aligned.invalid) == set(FAULTY)
    for p in result.proposals:
        if p.request_id in FAULTY:
            message = FAULTY[p.request_id][3]
            assert aligned.invalid[p.request_id].startswith(f"proposal {p.request_id!r}: ")
            with pytest.raises(ProposalError, match=message) as alone:
                decode_proposal(p, want, VOCAB)
            assert aligned.invalid[p.request_id] == str(alone.value)
