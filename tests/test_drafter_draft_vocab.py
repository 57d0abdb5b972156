"""EAGLE-3's reduced draft vocabulary: chosen by frequency, published as d2t / t2d, and exact end to end (the
drafter's q is zero outside the draft vocabulary and the rejection sampler's output still follows p)."""

import torch
from specwire.drafter.draft_vocab import (
    choose_draft_vocab,
    coverage,
    d2t_offsets,
    inside_mass,
    restricted_log_probs,
    t2d_mask,
)
from test_drafter_proposer import MAX_DRAFTS, Setup
from test_rejection_sampler import _emitted, _fits, _real_sampler


def test_choose_draft_vocab_takes_the_most_frequent_ids_ascending():
    texts = [[5, 5, 5, 9, 9, 2], [9, 7, 5, 2, 1]]  # 5: 4, 9: 3, 2: 2, 7: 1, 1: 1
    assert choose_draft_vocab(texts, 3, 12).tolist() == [2, 5, 9]
    assert choose_draft_vocab(texts, 4, 12).tolist() == [1, 2, 5, 9]  # a tie goes to the smaller id
    assert choose_draft_vocab([[3, 3]], 3, 12).tolist() == [0, 1, 3]  # padded with unseen ids
    chosen = choose_draft_vocab(texts, 3, 12)
    assert coverage(texts, chosen, 12) == 9 / 11


def test_d2t_and_t2d_are_the_published_offsets_and_mask():
    draft_to_target = torch.tensor([1, 4, 5, 11])
    assert d2t_offsets(draft_to_target).tolist() == [1, 3, 3, 8]
    assert (torch.arange(4) + d2t_offsets(draft_to_target)).tolist() == draft_to_target.tolist()
    mask = t2d_mask(draft_to_target, 12)
    assert mask.dtype == torch.bool and mask.nonzero().flatten().tolist() == [1, 4, 5, 11]


def test_restricted_log_probs_renormalise_the_target_over_the_draft_vocab():
    g = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(3, 6, generator=g), torch.randn(12, 6, generator=g)
    ids = torch.tensor([0, 2, 3, 7, 11])
    p = torch.softmax(hidden @ lm_head.T, -1)[:, ids]  # the full distribution, then restricted
    restricted = restricted_log_probs(hidden, lm_head, ids)
    assert restricted.dtype == torch.float32
    torch.testing.assert_close(restricted.exp(), p / p.sum(-1, keepdim=True))


def test_inside_mass_is_the_full_distributions_share_on_the_draft_vocab():
    g = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(2, 5, 6, generator=g), torch.randn(12, 6, generator=g)
    ids = torch.tensor([0, 2, 3, 7, 11])
    p = torch.softmax(hidden @ lm_head.T, -1)
    mass = inside_mass(hidden, lm_head, ids, rows=3)  # 10 positions in chunks of 3, 3, 3, 1
    assert mass.shape == (2, 5) and mass.dtype == torch.float32
    torch.testing.assert_close(mass, p[..., ids].sum(-1))
    torch.testing.assert_close(inside_mass(hidden, lm_head, torch.arange(12)), torch.ones(2, 5))


def test_reduced_vocab_drafts_map_to_target_ids_and_stay_lossless(tmp_path):
    s = Setup(tmp_path, "eagle3")
    targets = set(s.to_target(torch.arange(s.head.vocab_size)).tolist())
    V = s.target_config.vocab_size
    assert len(targets) == s.head.vocab_size < V  # a real reduction: 40 of 96 ids
    s.add("a", 7)
    s.add("b", 5)
    greedy = s.proposer.propose(["a"], [MAX_DRAFTS], [0.0], [0])
    assert set(greedy.token_ids.tolist()) <= targets
    s.update("a", 2)
    dense = s.proposer.propose(["a", "b"], [MAX_DRAFTS, MAX_DRAFTS], [1.0, 1.0], [0, 4])
    q = dense.probs.probs
    outside = torch.tensor([t not in targets for t in range(V)])
    assert q.shape == (2 * MAX_DRAFTS, V) and float(q[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(q.sum(-1), torch.ones(2 * MAX_DRAFTS))
    assert set(dense.token_ids.tolist()) <= targets
    # The sampler's statistical check with this q: emitted tokens follow p at every position, while drafts
    # can only ever propose draft-vocabulary ids (a full row and a top-4 row of the drafter's own q).
    g = torch.Generator().manual_seed(11)
    p_logits = torch.randn(MAX_DRAFTS + 1, V, generator=g) * 1.5
    p = torch.softmax(p_logits.double(), -1)
    for rows in (q[:MAX_DRAFTS], q[MAX_DRAFTS:]):
        counts = _emitted(_real_sampler, p_logits, rows, "dense", 20_000, seed=3, temperature=1.0)
        assert all(_fits(counts[j], p[j]) for j in range(MAX_DRAFTS + 1))
