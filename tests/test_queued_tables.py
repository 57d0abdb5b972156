"""Tables ahead (queue_after_verification with num_branches): the drafter drafts, while a verification runs,
a table of its outcomes, and the next queued round looks it up on the device from the sampler's output. A
round whose every request hit gets its branches' drafts (published at once, behind the lookup); one with a
miss gets the serial chains, kept so the next table can score their check. Checked against the from-scratch
reference chains: after a hit the settled tokens' K/V are the target's features (the next serial chains
match the reference), and a miss's drafts are the serial ones."""

import pytest
import torch
from specwire.drafter.proposer import ProposerError
from specwire.kernels.table_lookup import Publish
from test_drafter_branches import greedy_branch
from test_drafter_proposer import MAX_DRAFTS, Setup, greedy_chain, on_cuda, split

K, N = 3, 5  # drafts asked for, branches a table
T = MAX_DRAFTS + 1  # the proposer's first-step width: a verification settles at most max_drafts + 1 tokens


class Outcome:
    """One verification's settled tokens per request (given, or random), laid out as the verifier hands
    them over: the sampler's packed rows, and each request's target features in cells of a flat buffer."""

    def __init__(self, s: Setup, tokens: dict[str, list[int] | int]):
        self.order = list(tokens)
        B, F = len(tokens), s.head.config.feature_dim
        self.packed = torch.full((B, T + 1), -1, dtype=torch.int64)
        self.flat = torch.randn(B * T, F, generator=s.g)
        self.counts = []
        for b, (rid, ids) in enumerate(tokens.items()):
            ids = s.new_tokens(ids)[0] if isinstance(ids, int) else ids
            self.packed[b, 0] = len(ids) or -1  # nothing settled: the sampler's failed row
            self.packed[b, 1:1 + len(ids)] = torch.tensor(ids, dtype=torch.int64)
            self.counts.append(len(ids))
            old_ids, old_feats = s.history[rid]  # what the reference has seen from now on
            s.history[rid] = (old_ids + ids, torch.cat([old_feats, self.flat[b * T:b * T + len(ids)]]))

    def queue(self, s: Setup, forced_hit_rate: float | None = None):
        """queue_after_verification with tables, then take_queued; also returns what was published (a
        verifier's buffer [B, max_drafts] as the drafter left it, -1 where nothing was written) and whether
        the step's number was."""
        B, dev = len(self.order), s.head.device
        buffer = torch.full((B * MAX_DRAFTS,), -1, dtype=torch.int64, device=dev)
        slot = torch.zeros(1, dtype=torch.int64, device=dev)
        s.proposer.queue_after_verification(
            self.order, self.packed.to(dev), list(range(B)), self.flat.to(dev, s.head.dtype),
            list(range(B * T)), [K] * B, [0.0] * B, [0] * B, num_branches=[N] * B,
            forced_hit_rate=forced_hit_rate, publish=Publish(buffer, slot, 9))
        proposal = s.proposer.take_queued(self.counts)
        assert slot.item() in (0, 9)
        return proposal, buffer.view(B, MAX_DRAFTS).cpu(), slot.item() == 9


def start(s: Setup, rids: str):
    for rid, n in zip(rids, (7, 5, 9), strict=False):
        s.add(rid, n)
    return split(s.proposer.propose(list(rids), [K] * len(rids), [0.0] * len(rids), [0] * len(rids)))


@pytest.mark.parametrize("device", ["cpu", on_cuda()])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_hits_serve_the_tables_drafts_and_misses_the_serial_chains(tmp_path, arch, device):
    s = Setup(tmp_path, arch, device=device, max_branches=N)
    p = s.proposer
    start(s, "ab")
    # Round 1: no table yet (a miss): the serial chains, and tables drafted for their check.
    proposal, published, all_hit = Outcome(s, {"a": 2, "b": 1}).queue(s)
    chains = split(proposal)
    assert not all_hit and not p.tables_served and p.last_hits == p.last_lookups == 0
    assert (published == -1).all()
    assert chains == [greedy_chain(s, "a", K), greedy_chain(s, "b", K)]
    tables = {rid: list(p.requests[rid].branches) for rid in "ab"}
    assert all(tables.values())
    # Round 2: each request's outcome is an entry of its table: the entries' drafts, published at once.
    picked = {"a": tables["a"][-1], "b": tables["b"][0]}
    settled = {rid: chain[:e.accepted] + [e.bonus] for (rid, e), chain in zip(picked.items(), chains,
                                                                               strict=True)}
    proposal, published, all_hit = Outcome(s, settled).queue(s)
    assert all_hit and p.tables_served and p.last_hits == p.last_lookups == 2
    assert split(proposal) == [picked["a"].token_ids, picked["b"].token_ids]
    assert published[:, :K].tolist() == [picked["a"].token_ids, picked["b"].token_ids]
    # (the branches' drafts are the reference's: the prefix and bonus fed with the head's own features)
    prefix = chains[0][:picked["a"].accepted]
    ids, feats = s.history["a"]
    s.history["a"] = (ids[:-len(settled["a"])], feats[:-len(settled["a"])])
    assert picked["a"].token_ids == greedy_branch(s, "a", prefix, picked["a"].bonus, K)
    s.history["a"] = (ids, feats)
    # Round 3: a misses (a bonus its table does not hold), b hits: not every request hit, so both get their
    # serial chains, drafted after the hit's tokens were committed with the target's features.
    verifying = {rid: e.token_ids for rid, e in picked.items()}
    next_tables = {rid: p.requests[rid].branches for rid in "ab"}
    held = {e.bonus for e in next_tables["a"] if e.accepted == 1}
    bonus = next(t for t in range(s.head.config.target_vocab_size) if t not in held)
    hit_b = next_tables["b"][0]
    settled = {"a": verifying["a"][:1] + [bonus], "b": verifying["b"][:hit_b.accepted] + [hit_b.bonus]}
    proposal, _, all_hit = Outcome(s, settled).queue(s)
    assert not all_hit and not p.tables_served and p.last_hits == 1 and p.last_lookups == 2
    assert split(proposal) == [greedy_chain(s, "a", K), greedy_chain(s, "b", K)]


@pytest.mark.parametrize("device", ["cpu", on_cuda()])
def test_a_forced_hit_takes_the_likeliest_branch_for_the_accepted_count(tmp_path, device):
    """Synthetic benchmarks' random heads hit nothing: forced_hit_rate 1 takes, for every request whose table
    holds a branch for the number of drafts accepted, the first (likeliest) of them, whatever the bonus."""
    s = Setup(tmp_path, "eagle3", device=device, max_branches=N)
    p = s.proposer
    start(s, "a")
    proposal, _, _ = Outcome(s, {"a": 2}).queue(s)
    chain = split(proposal)[0]
    first = p.requests["a"].branches[0]
    held = {e.bonus for e in p.requests["a"].branches if e.accepted == first.accepted}
    bonus = next(t for t in range(s.head.config.target_vocab_size) if t not in held)
    proposal, published, all_hit = Outcome(s, {"a": chain[:first.accepted] + [bonus]}).queue(s, 1.0)
    assert all_hit and p.tables_served and split(proposal) == [first.token_ids]
    # at rate 0 the same outcome misses
    s2 = Setup(tmp_path, "eagle3", device=device, max_branches=N)
    start(s2, "a")
    proposal, _, _ = Outcome(s2, {"a": 2}).queue(s2)
    assert s2.proposer.requests["a"].branches[0].token_ids == first.token_ids
    proposal, _, all_hit = Outcome(s2, {"a": chain[:first.accepted] + [bonus]}).queue(s2, 0.0)
    assert not all_hit and not s2.proposer.tables_served


def test_a_table_from_another_call_or_a_failed_row_is_never_looked_up(tmp_path):
    s = Setup(tmp_path, "eagle3", max_branches=N)
    p = s.proposer
    start(s, "ab")
    chain = split(Outcome(s, {"a": 2, "b": 1}).queue(s)[0])[0]
    entry = p.requests["a"].branches[0]
    Outcome(s, {"b": 2}).queue(s)  # a later table call, without a: a's rows were drafted over
    proposal, _, all_hit = Outcome(s, {"a": chain[:entry.accepted] + [entry.bonus]}).queue(s)
    assert not all_hit and p.last_hits == p.last_lookups == 0
    assert split(proposal) == [greedy_chain(s, "a", K)]
    # a failed row settles nothing and keeps no table
    assert p.requests["a"].branches
    Outcome(s, {"a": []}).queue(s)
    assert p.requests["a"].branches == [] and p.requests["a"].table_at == -1


def test_tables_ahead_refuse_sampled_rows_and_drafters_without_branch_slots(tmp_path):
    s = Setup(tmp_path, "eagle3", max_branches=N)
    start(s, "a")
    o = Outcome(s, {"a": 2})
    with pytest.raises(ProposerError, match="greedy rows"):
        s.proposer.queue_after_verification(["a"], o.packed, [0], o.flat, list(range(T)), [K], [0.7], [4],
                                            num_branches=[N])
    plain = Setup(tmp_path, "eagle3")
    start(plain, "a")
    o = Outcome(plain, {"a": 2})
    with pytest.raises(ProposerError, match="branch slots"):
        plain.proposer.queue_after_verification(["a"], o.packed, [0], o.flat, list(range(T)), [K], [0.0],
                                                [0], num_branches=[N])


def test_the_verifier_asks_for_tables_while_a_whole_batch_is_likely_to_hit():
    """TablesAhead: a steady round's step asks while hit_rate ** rows >= 0.5 (greedy rows only); the rate
    moves with the lookups, and requests without a table to look in leave it as it is."""
    from specwire.verifier.alignment import Want
    from specwire.verifier.drafter_link import TablesAhead

    from specwire.metrics import VerifierMetrics

    greedy, sampled = Want(4, 0.0, 0), Want(4, 0.7, 8)
    ahead, metrics = TablesAhead(8, None), VerifierMetrics()
    assert ahead.ask([greedy] * 16, True) == 8 and ahead.ask([greedy, sampled], True) == 0
    assert TablesAhead(0).ask([greedy], True) == 0
    assert ahead.ask([greedy], False) == 0 == ahead.asked  # (not a steady round)
    ahead.count(metrics, rows=4, lookups=0, hits=0, served=False)  # a first round: no tables yet
    assert ahead.hit_rate == 1.0
    for _ in range(40):
        ahead.count(metrics, rows=4, lookups=4, hits=3, served=False)
    assert ahead.hit_rate == pytest.approx(0.75, abs=0.01)
    assert [ahead.ask([greedy] * b, True) for b in (1, 2, 3)] == [8, 8, 0]
    counts = {r: metrics.cache[r]._value.get() for r in ("hit", "miss", "unasked")}
    assert counts == {"hit": 120, "miss": 40, "unasked": 4}


@pytest.mark.parametrize("faster", ["tables", "serial"])
def test_the_verifier_asks_for_tables_while_they_measure_faster_than_serial_rounds(faster):
    """With an epoch, rounds that may ask run in epochs with tables and without (DraftingMode's "tables" and
    "serial"), and the faster measured asks, the other retried now and then. Rounds whose steps could not
    ask (batch too large to hit, sampled rows) are not measured."""
    from specwire.verifier.alignment import Want
    from specwire.verifier.drafter_link import TablesAhead

    greedy, sampled = Want(4, 0.0, 0), Want(4, 0.7, 8)
    ahead = TablesAhead(8, None, epoch_rounds=4)
    asked = []
    for _ in range(400):
        asked.append(ahead.ask([greedy], True) > 0)
        # two tokens a round: in 2.2 ms with tables (1.8 ms where they pay), in 2.0 ms without
        seconds = (1.8e-3 if faster == "tables" else 2.2e-3) if asked[-1] else 2.0e-3
        ahead.round_ended(2, 1, seconds)
    assert ahead.measure.mode == faster and ahead.measure.rate["tables"] and ahead.measure.rate["serial"]
    share = sum(asked[200:]) / 200
    assert share > 0.9 if faster == "tables" else share < 0.2, share
    # steps that could not ask leave the measure as it is
    before = dict(ahead.measure.rate), ahead.measure._rounds
    for wants in ([sampled], [greedy] * 64):
        ahead.ask(wants, True)
        ahead.round_ended(5, 1, 1.0)
    ahead.ask([greedy], False)
    ahead.round_ended(5, 1, 1.0)
    assert (dict(ahead.measure.rate), ahead.measure._rounds) == before
    assert TablesAhead(8, None).measure is None and TablesAhead(0, None, epoch_rounds=4).measure is None
