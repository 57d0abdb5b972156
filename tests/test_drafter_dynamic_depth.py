"""Dynamic draft length (EagleProposer min_confidence): chains and speculation-cache branches stop before the
first draft after their first whose step has a top probability below the threshold, checked against the
from-scratch reference head; an eager loop stops drafting once every row has stopped."""

import pytest
import torch
from specwire.drafter.proposer import ProposerError
from test_drafter_branches import first_table, greedy_branch
from test_drafter_proposer import Setup, greedy_chain, split

K = 4


def setup(tmp_path, name: str, arch: str, **kwargs) -> Setup:
    """A Setup in its own folder; every Setup of an arch gets the same head, tokens and features (seeded)."""
    (tmp_path / name).mkdir()
    return Setup(tmp_path / name, arch, **kwargs)


def step_tops(s: Setup, rid: str, tokens: list[int]) -> list[float]:
    """The top probability of each reference step that drew one of `tokens`."""
    return torch.softmax(s.chain_logits(rid, tokens)[:-1], -1).amax(-1).tolist()


def confident_prefix(s: Setup, rid: str, before: list[int], drafts: list[int], threshold: float) -> list[int]:
    """The drafts kept by the rule: steps are those after `before` (the reference logits that drew each); the
    first draft always stays."""
    top = step_tops(s, rid, [*before, *drafts])[len(before):]
    kept = next((j for j, p in enumerate(top) if j > 0 and p < threshold), len(drafts))
    return drafts[:kept]


def midway(tops: list[float]) -> float:
    """A threshold that cuts some chains and keeps others: halfway between the two middle top probabilities
    that differ by more than 1e-4 (never one of them, or so near one that rounding could put it on either
    side; a random head's steps often sit at 1.0)."""
    distinct = []
    for p in sorted(tops):
        if not distinct or p > distinct[-1] + 1e-4:
            distinct.append(p)
    return (distinct[len(distinct) // 2 - 1] + distinct[len(distinct) // 2]) / 2


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_chains_stop_before_the_first_unconfident_draft(tmp_path, arch):
    plain = setup(tmp_path, "plain", arch)
    for rid, n in [("a", 9), ("b", 3), ("c", 12), ("d", 5), ("e", 7), ("f", 4)]:
        plain.add(rid, n)
    order = ["a", "b", "c", "d", "e", "f"]
    chains = {rid: greedy_chain(plain, rid, K) for rid in order}
    threshold = midway([p for rid, drafts in chains.items() for p in step_tops(plain, rid, drafts)[1:]])

    s = setup(tmp_path, "dynamic", arch, min_confidence=threshold)
    for rid, n in [("a", 9), ("b", 3), ("c", 12), ("d", 5), ("e", 7), ("f", 4)]:
        s.add(rid, n)  # the same tokens and features: Setup's generator is seeded
    p = s.proposer.propose(order, [K] * 6, [0.0] * 6, [0] * 6)
    want = [confident_prefix(s, rid, [], chains[rid], threshold) for rid in order]
    assert split(p) == want and p.num_drafts.tolist() == [len(w) for w in want]
    assert {len(w) for w in want} != {K}, "the threshold should cut some chain"


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_branches_stop_before_the_first_unconfident_draft(tmp_path, arch):
    plain = setup(tmp_path, "plain", arch, max_branches=5)
    plain.add("a", 7)
    table, _ = first_table(plain, "a")
    chains = {b.bonus: greedy_branch(plain, "a", [], b.bonus, 3) for b in table}
    threshold = midway([p for bonus, drafts in chains.items()
                        for p in step_tops(plain, "a", [bonus, *drafts])[1:]])

    s = setup(tmp_path, "dynamic", arch, max_branches=5, min_confidence=threshold)
    s.add("a", 7)
    dynamic, _ = first_table(s, "a")
    assert [b.bonus for b in dynamic] == list(chains)
    kept = [confident_prefix(s, "a", [b.bonus], chains[b.bonus], threshold) for b in dynamic]
    assert [b.token_ids for b in dynamic] == kept
    assert {len(k) for k in kept} != {3}, "the threshold should cut some branch"


def test_an_eager_loop_stops_once_no_row_is_confident(tmp_path):
    s = Setup(tmp_path, "eagle3", min_confidence=0.999)
    s.add("a", 6)
    s.add("b", 8)
    calls = []
    logits = s.head.logits
    s.head.logits = lambda hidden: calls.append(hidden.shape) or logits(hidden)
    p = s.proposer.propose(["a", "b"], [K, K], [0.0, 0.0], [0, 0])
    assert p.num_drafts.tolist() == [1, 1] and len(calls) == 2  # the first draft kept, the second step cut


def test_min_confidence_is_a_probability(tmp_path):
    with pytest.raises(ProposerError, match="min_confidence"):
        Setup(tmp_path, "eagle1", min_confidence=1.0)
