"""Drafts queued on the device behind a verification's sampler (EagleProposer.queue_after_verification, then
take_queued) must be the drafts a DraftStep's update + propose would give: the same chains as the
from-scratch reference, the same exact q for sampled rows, and the same committed state for the rounds
after. The settled tokens come in the sampler's packed layout (count, tokens, -1 padding; a failed row's
count is -1) in rows of another order than the requests', and each request's features from scattered rows
of a flat buffer, as a co-located verifier's feature store holds them."""

import pytest
import torch
from specwire.drafter.proposer import ProposerError
from test_drafter_head import VOCAB
from test_drafter_proposer import MAX_DRAFTS, Setup, greedy_chain, on_cuda, split

T = MAX_DRAFTS + 1  # the proposer's first-step width: a verification settles at most k + 1 tokens


class Settled:
    """One verification's outcome for some requests, laid out as the verifier hands it over."""

    def __init__(self, s: Setup, counts: dict[str, int], seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        F = s.head.config.feature_dim
        self.order = list(counts)
        self.rows = torch.randperm(len(counts) + 1, generator=g)[:len(counts)].tolist()  # one spare row
        self.packed = torch.full((len(counts) + 1, T + 2), -1, dtype=torch.int64)
        self.flat = torch.randn(4 * T * len(counts), F, generator=g)  # rows nobody reads are garbage
        cells = torch.randperm(self.flat.shape[0], generator=g)[:T * len(counts)].view(len(counts), T)
        self.tokens: dict[str, tuple[list[int], torch.Tensor]] = {}
        for (rid, n), row, cell in zip(counts.items(), self.rows, cells, strict=True):
            self.packed[row, 0] = n
            if n > 0:
                ids, feats = s.new_tokens(n)
                self.packed[row, 1:1 + n] = torch.tensor(ids)
                self.flat[cell[:n]] = feats
                self.tokens[rid] = (ids, feats)
        self.cells = cells.flatten().tolist()
        self.counts = [max(n, 0) for n in counts.values()]

    def queue(self, s: Setup, ks: list[int], temps: list[float], top_k: list[int], on_device: bool = False):
        device = s.head.device
        s.proposer.queue_after_verification(self.order, self.packed.to(device), self.rows,
                                            self.flat.to(device, s.head.dtype), self.cells, ks, temps, top_k)
        for rid, (ids, feats) in self.tokens.items():  # what the reference has seen from now on
            old_ids, old_feats = s.history[rid]
            s.history[rid] = (old_ids + ids, torch.cat([old_feats, feats]))
        return s.proposer.take_queued(self.counts, on_device)


@pytest.mark.parametrize("on_device", [False, True], ids=["read", "left_on_device"])
@pytest.mark.parametrize("device", ["cpu", on_cuda()])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_queued_greedy_drafts_are_the_reference_chains(tmp_path, arch, device, on_device):
    """Also with the draft ids left on the drafter's device (take_queued(on_device=True)), as a co-located
    verifier feeds them to its next verification."""
    s = Setup(tmp_path, arch, device=device)
    for rid, n in [("a", 9), ("b", 3), ("c", 12), ("d", 5), ("e", 4)]:
        s.add(rid, n)
    s.proposer.propose(list("abcde"), [4, 2, 3, 1, 2], [0.0] * 5, [0] * 5)

    # a verification settles 1..k + 1 tokens per request; e's row failed (count -1: nothing settles)
    order, ks = ["c", "a", "e", "d", "b"], [4, 3, 2, 4, 1]
    settled = Settled(s, {"c": T, "a": 1, "e": -1, "d": 3, "b": 2})
    p = settled.queue(s, ks, [0.0] * 5, [0] * 5, on_device)
    assert p.probs is None and p.num_drafts.tolist() == ks
    assert p.token_ids.device.type == (device if on_device else "cpu")
    chains = split(p)
    for rid, k, chain in zip(order, ks, chains, strict=True):
        if rid != "e":  # a failed row's drafts are never used
            assert chain == greedy_chain(s, rid, k), rid

    # The rounds after, through DraftSteps' updates: the queued round committed exactly its tokens (and e
    # none), so the chains still match the reference.
    for rid, n in [("a", 2), ("e", 3), ("c", 1)]:
        s.update(rid, n)
    p = s.proposer.propose(["a", "e", "c"], [4, 4, 2], [0.0] * 3, [0] * 3)
    assert split(p) == [greedy_chain(s, r, k) for r, k in [("a", 4), ("e", 4), ("c", 2)]]
    # and another queued round on top of those
    p = Settled(s, {"e": 4, "a": 1}, seed=4).queue(s, [3, 4], [0.0, 0.0], [0, 0], on_device)
    assert split(p) == [greedy_chain(s, "e", 3), greedy_chain(s, "a", 4)]


@pytest.mark.parametrize("on_device", [False, True], ids=["read", "left_on_device"])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_queued_sampled_drafts_ship_the_q_a_draft_step_would(tmp_path, arch, on_device):
    """Same random draws (one seed) through both paths: the same drafts and bit for bit the same top-K and
    dense q, for greedy, truncated and untruncated rows in one batch."""
    for name in "sq":
        (tmp_path / name).mkdir()
    stepped, queued = Setup(tmp_path / "s", arch), Setup(tmp_path / "q", arch)
    order, ks, temps, top_k = ["a", "b", "c"], [3, 4, 2], [0.8, 0.0, 1.2], [5, 0, 0]
    for s in (stepped, queued):
        for rid, n in [("a", 7), ("b", 4), ("c", 10)]:
            s.add(rid, n)
        torch.manual_seed(1)
        s.proposer.propose(order, ks, temps, top_k)

    settled = Settled(queued, {"a": 2, "b": 5, "c": 1})
    for rid in order:  # the same tokens and features, told the other proposer by update()
        ids, feats = settled.tokens[rid]
        stepped.proposer.update(rid, ids, feats)
    torch.manual_seed(2)
    want = stepped.proposer.propose(order, ks, temps, top_k)
    torch.manual_seed(2)
    got = settled.queue(queued, ks, temps, top_k, on_device)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert got.num_drafts.tolist() == want.num_drafts.tolist()
    assert got.probs.is_dense and want.probs.is_dense
    torch.testing.assert_close(got.probs.probs, want.probs.probs, rtol=0, atol=0)


def test_queueing_needs_every_pending_token_drafted_and_the_queue_taken(tmp_path):
    s = Setup(tmp_path, "eagle3")
    s.add("a", 6)
    settled = Settled(s, {"a": 2})
    with pytest.raises(ProposerError, match="'a' has tokens pending"):
        s.proposer.queue_after_verification(["a"], settled.packed, settled.rows, settled.flat, settled.cells,
                                            [2], [0.0], [0])
    s.proposer.propose(["a"], [2], [0.0], [0])
    original = s.proposer.queue_after_verification

    def propose_before_taking(*args):
        original(*args)
        with pytest.raises(ProposerError, match="not taken yet"):
            s.proposer.propose(["a"], [2], [0.0], [0])

    s.proposer.queue_after_verification = propose_before_taking
    # the refusal changed nothing
    assert split(settled.queue(s, [2], [0.0], [0])) == [greedy_chain(s, "a", 2)]


@pytest.mark.parametrize("top_k", [[0, 5, 3], [4, 5, 3]], ids=["dense", "sparse"])
def test_queued_drafts_reach_the_verifier_as_a_draft_result_would(tmp_path, top_k):
    """The co-located link hands the verifier queued drafts without a message: per request, the drafts and q
    of the kind its want asked for must be what the drafter's DraftResult, decoded and checked by the
    verifier, would have given (greedy rows without q; top-K rows' q cut to their width)."""
    from specwire.drafter.server import DrafterService
    from specwire.verifier.alignment import Want, read_result
    from specwire.verifier.drafter_link import _drafts_by_request

    from specwire.metrics import DrafterMetrics
    from specwire.v1 import drafter_pb2 as pb

    s = Setup(tmp_path, "eagle3")
    order, ks, temps = ["a", "b", "c"], [3, 2, 4], [0.9, 0.0, 1.1]
    top_k = [tk if t > 0 else 0 for t, tk in zip(temps, top_k, strict=True)]
    for rid, n in [("a", 7), ("b", 4), ("c", 10)]:
        s.add(rid, n)
    proposal = s.proposer.propose(order, ks, temps, top_k)
    wants = [Want(k, t, tk) for k, t, tk in zip(ks, temps, top_k, strict=True)]

    result = pb.DraftResult()
    messages = [pb.DraftWant(request_id=r, num_drafts=w.num_drafts, temperature=w.temperature, top_k=w.top_k)
                for r, w in zip(order, wants, strict=True)]
    DrafterService(DrafterMetrics())._split(messages, proposal, temps, top_k, result)
    decoded = read_result(result, dict(zip(order, wants, strict=True)), VOCAB)
    assert not decoded.invalid and len(decoded.drafts) == 3

    handed = _drafts_by_request(order, wants, proposal)
    assert handed.keys() == decoded.drafts.keys()
    for rid in order:
        got, want = handed[rid], decoded.drafts[rid]
        assert got.token_ids == want.token_ids, rid
        for name in ("indices", "values", "probs"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), (rid, name)
            if a is not None:
                torch.testing.assert_close(a.to(b.dtype), b, rtol=0, atol=0, msg=f"{rid} {name}")


@pytest.mark.parametrize("device", ["cpu", on_cuda()])
@pytest.mark.parametrize("top_k", [[0, 5, 3], [4, 5, 3]], ids=["dense", "sparse"])
def test_queued_drafts_fed_whole_carry_the_q_the_split_would(tmp_path, top_k, device):
    """A verification of exactly the queued rows takes the drafter's proposal whole, q of sampled rows
    included, where the drafter left it (QueuedDrafts.as_batch). Row by row over the target vocabulary that
    q must be what the per-request split merges with batch_drafts (greedy rows one-hot at their draft), so
    the sampler sees the same distributions either way."""
    from specwire.verifier.alignment import Want, batch_drafts
    from specwire.verifier.drafter_link import QueuedDrafts

    s = Setup(tmp_path, "eagle3", device=device)
    order, ks, temps = ["a", "b", "c"], [3, 2, 4], [0.9, 0.0, 1.1]
    top_k = [tk if t > 0 else 0 for t, tk in zip(temps, top_k, strict=True)]
    for rid, n in [("a", 7), ("b", 4), ("c", 10)]:
        s.add(rid, n)
    s.proposer.propose(order, ks, temps, top_k)
    proposal = Settled(s, {"a": 2, "b": 1, "c": 3}).queue(s, ks, temps, top_k, on_device=True)
    wants = [Want(k, t, tk) for k, t, tk in zip(ks, temps, top_k, strict=True)]
    queued = QueuedDrafts(order, wants, proposal)

    whole = queued.as_batch(order, ks)
    assert whole is proposal and whole.probs is not None
    assert whole.token_ids.device.type == device and (whole.probs.values if whole.probs.probs is None
                                                      else whole.probs.probs).device.type == device
    split = batch_drafts(order, queued.per_request(), VOCAB)
    assert [len(t) for t in split.token_ids] == whole.num_drafts.tolist()
    assert [t for row in split.token_ids for t in row] == whole.token_ids.tolist()
    torch.testing.assert_close(dense_q(whole.probs), dense_q(split.probs), rtol=0, atol=0)
    # Anything but the same rows in the same order, each within its room, goes through the split.
    assert queued.as_batch(["b", "a", "c"], ks) is None
    assert queued.as_batch(order, [3, 1, 4]) is None
    queued.dropped.add("b")
    assert queued.as_batch(order, ks) is None


def dense_q(q) -> torch.Tensor:
    """A DraftProbs as [D, VOCAB] rows (sparse slots of -1 unused)."""
    if q.is_dense:
        return q.probs.cpu()
    indices, values = q.indices.cpu(), q.values.cpu()
    used = torch.where(indices >= 0, values, 0.0)
    return torch.zeros(len(indices), VOCAB).scatter_add_(1, indices.clamp_min(0), used)
