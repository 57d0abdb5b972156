"""Speculation-cache tables (EagleProposer.draft_branches): branches scored and drafted against a from-scratch
reference, the committed K/V rewritten with the target's features after a hit, tables for the check of a
chain drafted just in time after a miss, exact q for sampled branches, refused mismatches, slots returned;
(GPU) CUDA-graph replay against eager."""

import pytest
import torch
from specwire.drafter.proposer import VERIFYING_CHAIN, ProposerError
from test_drafter_head import VOCAB
from test_drafter_proposer import Setup, greedy_chain, split

K, N = 3, 5


def greedy_branch(s: Setup, rid: str, prefix: list[int], bonus: int, k: int) -> list[int]:
    """The reference chain after appending prefix + [bonus] with the head's own features."""
    drafts = []
    for _ in range(k):
        logits = s.chain_logits(rid, [*prefix, bonus, *drafts])[-1]
        drafts.append(int(s.to_target(logits.argmax())))
    return drafts


def first_table(s: Setup, rid: str, n: int = N):
    table = s.proposer.draft_branches([rid], [None], [n], [K], [0.0], [0])[0]
    q = torch.softmax(s.chain_logits(rid, [])[-1], -1)
    return table, q


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_first_table_holds_the_likeliest_bonus_tokens_and_their_chains(tmp_path, arch):
    s = Setup(tmp_path, arch, max_branches=N)
    s.add("a", 7)
    table, q = first_table(s, "a")
    want = s.to_target(q.topk(N).indices).tolist()  # nothing is in flight: only a = 0 outcomes
    assert [b.accepted for b in table] == [0] * N and [b.bonus for b in table] == want
    for b in table:
        assert b.q_indices is None and b.token_ids == greedy_branch(s, "a", [], b.bonus, K)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_hit_commits_target_features_and_scores_every_outcome_of_the_check_in_flight(tmp_path, arch):
    s = Setup(tmp_path, arch, max_branches=N)
    s.add("a", 6)
    table, _ = first_table(s, "a")
    hit = table[2]
    # The verifier settled hit.bonus (with the target's feature of the position before it) and now checks
    # hit's drafts.
    feature = torch.randn(1, s.head.config.feature_dim, generator=s.g)
    s.proposer.update("a", [hit.bonus], feature)
    ids, feats = s.history["a"]
    s.history["a"] = (ids + [hit.bonus], torch.cat([feats, feature]))
    free_before = len(s.proposer._free_slots)
    table2 = s.proposer.draft_branches(["a"], [2], [N], [K], [0.0], [0])[0]
    assert len(s.proposer._free_slots) == free_before + (N - 1) + 1 - len(table2)  # old table, old main slot
    outcomes = {(b.accepted, b.bonus) for b in table2}
    assert len(outcomes) == len(table2) == N
    for b in table2:
        assert 0 <= b.accepted <= K
        if b.accepted < K:  # the target rejected draft a + 1, so it is not the bonus
            assert b.bonus != hit.token_ids[b.accepted]
    # a = 0 outcomes read the committed output, which now sees the target's feature for hit.bonus: exact.
    for b in table2:
        if b.accepted == 0:
            assert b.token_ids == greedy_branch(s, "a", [], b.bonus, K)


def to_draft_vocab(s: Setup, target_ids: list[int]) -> list[int]:
    draft_to_target = s.to_target(torch.arange(s.head.vocab_size)).tolist()
    return [draft_to_target.index(t) for t in target_ids]


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_table_for_the_check_of_a_chain_drafted_after_a_miss(tmp_path, arch):
    """After a miss the verifier asks for drafts just in time (propose with keep_chain) and, while it checks
    them, for a table of that check's outcomes: scored and drafted exactly as for a branch's check."""
    s = Setup(tmp_path, arch, max_branches=N)
    s.add("a", 6)
    first_table(s, "a")
    s.update("a", 2)  # an outcome the table did not hold: its branches are dropped
    free = len(s.proposer._free_slots)
    chain = split(s.proposer.propose(["a"], [K], [0.0], [0], keep_chain=True))[0]
    assert chain == greedy_chain(s, "a", K)  # from the target's features, as serial drafting drafts
    assert len(s.proposer._free_slots) == free + N
    table = s.proposer.draft_branches(["a"], [VERIFYING_CHAIN], [N], [K], [0.0], [0])[0]

    q = torch.softmax(s.chain_logits("a", chain).double(), -1)  # [K + 1, draft vocab]: after 0..K drafts
    drafted = to_draft_vocab(s, chain)
    reach = torch.cat([torch.ones(1), q[torch.arange(K), drafted].cumprod(0)])
    bonus_q = q.clone()
    bonus_q[torch.arange(K), drafted] = 0.0  # the bonus after a rejected draft is not that draft
    top = (reach[:, None] * bonus_q).flatten().topk(N).indices
    want = {(int(i) // q.shape[1], int(s.to_target(i % q.shape[1]))) for i in top}
    assert {(b.accepted, b.bonus) for b in table} == want
    for b in table:  # the branch's prefix is the chain's accepted drafts, fed with the head's own outputs
        assert b.token_ids == greedy_branch(s, "a", chain[:b.accepted], b.bonus, K)

    # A hit on that table is checked as any branch is.
    hit = max(table, key=lambda b: b.accepted)
    feature = torch.randn(hit.accepted + 1, s.head.config.feature_dim, generator=s.g)
    s.proposer.update("a", chain[:hit.accepted] + [hit.bonus], feature)
    s.proposer.draft_branches(["a"], [hit.index], [N], [K], [0.0], [0])


def test_a_chain_is_verifiable_only_until_tokens_settle_after_it(tmp_path):
    s = Setup(tmp_path, "eagle3", max_branches=N)
    s.add("a", 6)
    s.proposer.propose(["a"], [K], [0.0], [0])
    with pytest.raises(ProposerError, match="no chain to verify"):  # not kept
        s.proposer.draft_branches(["a"], [VERIFYING_CHAIN], [N], [K], [0.0], [0])
    s.update("a", 2)
    s.proposer.propose(["a"], [K], [0.0], [0], keep_chain=True)
    s.update("a", 3)  # the verifier went on without a table: the next drafts come from these tokens
    with pytest.raises(ProposerError, match="no chain to verify"):
        s.proposer.draft_branches(["a"], [VERIFYING_CHAIN], [N], [K], [0.0], [0])
    assert split(s.proposer.propose(["a"], [K], [0.0], [0]))[0] == greedy_chain(s, "a", K)
    with pytest.raises(ProposerError, match="branch slots"):
        Setup(tmp_path, "eagle3").proposer.propose([], [], [], [], keep_chain=True)


def test_uniform_outcomes_deal_branches_to_every_number_of_accepted_drafts(tmp_path):
    """Synthetic benchmarks (random heads): a table for a check of K drafts holds a branch for every
    a = 0..K, each a's likeliest bonus tokens first, so a forced hit rate can be met whatever a comes."""
    branches = 2 * (K + 1) + 1
    s = Setup(tmp_path, "eagle3", max_branches=branches, uniform_outcomes=True)
    s.add("a", 6)
    first = s.proposer.draft_branches(["a"], [None], [branches], [K], [0.0], [0])[0]
    q = torch.softmax(s.chain_logits("a", [])[-1], -1)
    assert [b.accepted for b in first] == [0] * branches  # nothing in flight: only a = 0 can come
    assert [b.bonus for b in first] == s.to_target(q.topk(branches).indices).tolist()
    hit = first[0]
    s.proposer.update("a", [hit.bonus], torch.randn(1, s.head.config.feature_dim, generator=s.g))
    table = s.proposer.draft_branches(["a"], [0], [branches], [K], [0.0], [0])[0]
    per_a = [sum(b.accepted == a for b in table) for a in range(K + 1)]
    assert sorted(per_a) == [2] * K + [3]  # dealt in turn: every a twice, then the ninth by q
    for a in range(K):  # the rejected draft is never the bonus after a accepted
        assert all(b.bonus != hit.token_ids[a] for b in table if b.accepted == a)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_sampled_branches_ship_the_exact_top_k_q(tmp_path, arch):
    s = Setup(tmp_path, arch, max_branches=N)
    s.add("a", 5)
    t, tk = 0.8, 4
    table = s.proposer.draft_branches(["a"], [None], [N], [K], [t], [tk])[0]
    for b in table:
        logits = s.chain_logits("a", [b.bonus, *b.token_ids])[1:]
        for j in range(K):
            top = torch.softmax(logits[j] / t, -1).topk(tk)
            want = torch.zeros(VOCAB).index_put_((s.to_target(top.indices),), top.values / top.values.sum())
            used = b.q_indices[j] >= 0
            got = torch.zeros(VOCAB).index_put_((b.q_indices[j][used],), b.q_values[j][used])
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
            assert b.token_ids[j] in b.q_indices[j][used].tolist()


def test_a_branch_that_does_not_match_the_settled_tokens_is_refused(tmp_path):
    s = Setup(tmp_path, "eagle3", max_branches=N)
    s.add("a", 6)
    table, _ = first_table(s, "a")
    wrong = next(t for t in range(VOCAB) if t != table[1].bonus)
    s.proposer.update("a", [wrong], torch.randn(1, s.head.config.feature_dim))
    with pytest.raises(ProposerError, match="do not match branch 1"):
        s.proposer.draft_branches(["a"], [1], [N], [K], [0.0], [0])
    with pytest.raises(ProposerError, match="no branch 9"):
        s.proposer.draft_branches(["a"], [9], [N], [K], [0.0], [0])


def test_free_returns_every_branch_slot(tmp_path):
    s = Setup(tmp_path, "eagle1", max_branches=N)
    total = len(s.proposer._free_slots)
    for rid in "abc":
        s.add(rid, 5)
    s.proposer.draft_branches(list("abc"), [None] * 3, [N, 2, 0], [K, K, K], [0.0] * 3, [0] * 3)
    assert len(s.proposer._free_slots) == total - 3 - N - 2
    for rid in "abc":
        s.proposer.free(rid)
    assert sorted(s.proposer._free_slots) == list(range(total))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_branch_graph_replay_matches_eager(tmp_path, temperature):
    tables = []
    for graphs in (False, True):
        s = Setup(tmp_path, "eagle3", device="cuda", max_branches=N, cuda_graphs=graphs, max_requests=6)
        for rid, n in [("a", 9), ("b", 3), ("c", 12)]:
            s.add(rid, n)
        tk = 4 if temperature else 0
        first = s.proposer.draft_branches(list("abc"), [None] * 3, [N, 3, N], [K, 2, K], [temperature] * 3,
                                          [tk] * 3)
        # every request hits its first branch; then a second table
        for rid, table in zip("abc", first, strict=True):
            feature = torch.randn(1, s.head.config.feature_dim, generator=s.g).cuda()
            s.proposer.update(rid, [table[0].bonus], feature)
        second = s.proposer.draft_branches(list("abc"), [0, 0, 0], [N, 3, N], [K, 2, K], [temperature] * 3,
                                           [tk] * 3)
        # a misses: drafts just in time (the graph keeps the chain), then a table for their check
        s.proposer.update("a", [1], torch.randn(1, s.head.config.feature_dim, generator=s.g).cuda())
        chain = split(s.proposer.propose(["a"], [K], [temperature], [tk], keep_chain=True))[0]
        third = s.proposer.draft_branches(["a"], [VERIFYING_CHAIN], [N], [K], [temperature], [tk])
        tables.append([[(b.accepted, b.bonus, b.token_ids) for b in t] for t in first + second + third]
                      + [chain])
    if temperature == 0:
        assert tables[0] == tables[1]
    else:  # sampled drafts differ by the random stream, so only the first tables' outcomes must agree
        assert [[x[:2] for x in t] for t in tables[0][:3]] == [[x[:2] for x in t] for t in tables[1][:3]]
