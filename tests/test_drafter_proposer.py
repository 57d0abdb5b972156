"""EagleProposer: chains against a from-scratch reference, per-request k, join/leave, exact q payloads,
and (GPU) CUDA-graph replay against eager."""

import pytest
import torch
from specwire.drafter import proposer as proposer_module
from specwire.drafter.draft_sampling import sample_drafts
from specwire.drafter.eagle_head import load_eagle_head
from specwire.drafter.proposer import EagleProposer, ProposerError
from test_drafter_head import VOCAB, reference_head, tiny_target, write_head

from specwire.engine import PREFILL_ROW

MAX_DRAFTS = 4


class Setup:
    """A tiny target, a published-format head on it, and the reference for whole chains."""

    def __init__(self, tmp_path, arch: str, device: str = "cpu", **proposer_kwargs):
        self.arch = arch
        self.target_config, self.target_sd = tiny_target()
        self.sd = write_head(tmp_path, arch, "safetensors")
        self.head = load_eagle_head(tmp_path, self.target_config, self.target_sd, device=device)
        kwargs = {
            "max_requests": 6,
            "max_context": 64,
            "max_drafts": MAX_DRAFTS,
            "max_top_k": 8,
        } | proposer_kwargs
        self.proposer = EagleProposer(self.head, **kwargs)
        self.g = torch.Generator().manual_seed(7)
        self.history: dict[str, tuple[list[int], torch.Tensor]] = {}  # tokens, target features

    def new_tokens(self, n: int) -> tuple[list[int], torch.Tensor]:
        ids = torch.randint(0, VOCAB, (n,), generator=self.g).tolist()
        return ids, torch.randn(n, self.head.config.feature_dim, generator=self.g)

    def add(self, rid: str, n: int) -> None:
        ids, feats = self.new_tokens(n)
        feats = feats[:-1]
        self.proposer.add(rid, ids, feats.to(self.head.device))
        self.history[rid] = (ids, feats)

    def update(self, rid: str, n: int) -> None:
        ids, feats = self.new_tokens(n)
        self.proposer.update(rid, ids, feats.to(self.head.device))
        old_ids, old_feats = self.history[rid]
        self.history[rid] = (old_ids + ids, torch.cat([old_feats, feats]))

    def chain_logits(self, rid: str, drafts: list[int]) -> torch.Tensor:
        """Reference logits [len(drafts) + 1, vocab] that drafted drafts[0], drafts[1], ... and the next."""
        ids, feats = self.history[rid]
        tokens, own = list(ids[1:]), torch.zeros(0, self.head.config.layer.hidden_size)
        logits = []
        for j in range(len(drafts) + 1):
            out, lg = self.reference(torch.tensor([tokens]), feats[None], own[None])
            logits.append(lg[0, -1])
            if j < len(drafts):
                tokens.append(drafts[j])
                own = torch.cat([own, out[0, -1:]])
        return torch.stack(logits)

    def reference(self, ids, feats, own):
        if self.arch == "eagle1":  # own outputs go through fc like target features
            return reference_head("eagle1", self.sd, self.target_sd, ids, torch.cat([feats, own], 1))
        fc = self.sd["fc.weight"]
        return reference_head(
            "eagle3",
            self.sd | {"fc.weight": torch.eye(fc.shape[0])},
            self.target_sd,
            ids,
            torch.cat([feats @ fc.T, own], 1),
        )

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.arch == "eagle1":
            return draft_ids
        return (torch.arange(self.sd["lm_head.weight"].shape[0]) + self.sd["d2t"])[draft_ids]


def split(proposal) -> list[list[int]]:
    counts = proposal.num_drafts.tolist()
    flat = proposal.token_ids.tolist()
    return [flat[sum(counts[:b]) : sum(counts[: b + 1])] for b in range(len(counts))]


def greedy_chain(s: Setup, rid: str, k: int) -> list[int]:
    drafts = []
    for _ in range(k):
        drafts.append(int(s.to_target(s.chain_logits(rid, drafts)[-1].argmax())))
    return drafts


def on_cuda():
    return pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")])


# On CUDA the features are handed on the device, as a co-located verifier hands them: they reach the head
# through the proposer's one gather (its cells) into the captured graphs' inputs, not its host copy.
@pytest.mark.parametrize("device", ["cpu", on_cuda()])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_greedy_chains_per_request_k_and_join_leave(tmp_path, arch, device):
    s = Setup(tmp_path, arch, device=device)
    for rid, n in [("a", 9), ("b", 3), ("c", 12), ("d", 5)]:  # c: longer than the first-step width
        s.add(rid, n)
    order, ks = ["c", "a", "d", "b"], [3, 0, 1, 4]
    p = s.proposer.propose(order, ks, [0.0] * 4, [0] * 4)
    assert p.probs is None and p.num_drafts.tolist() == ks
    assert split(p) == [greedy_chain(s, r, k) for r, k in zip(order, ks, strict=True)]

    # Round 2: a and b accepted some tokens, d leaves, e joins into d's freed slot, c sits out.
    s.update("a", 1)
    s.update("b", 3)
    s.proposer.free("d")
    s.add("e", 6)
    order, ks = ["e", "b", "a"], [2, 4, 3]
    p = s.proposer.propose(order, ks, [0.0] * 3, [0] * 3)
    assert split(p) == [greedy_chain(s, r, k) for r, k in zip(order, ks, strict=True)]

    # c was skipped a round: two updates' worth of pending pairs (more than the first-step width).
    s.update("c", 4)
    s.update("c", 3)
    p = s.proposer.propose(["c"], [4], [0.0], [0])
    assert split(p) == [greedy_chain(s, "c", 4)]

    # A round with no drafts at all still commits the pending pairs; the next round drafts from them.
    s.update("e", 2)
    p = s.proposer.propose(["e", "a"], [0, 0], [0.0, 0.0], [0, 0])
    assert p.token_ids.numel() == 0 and p.num_drafts.tolist() == [0, 0] and p.probs is None
    s.update("e", 1)
    assert split(s.proposer.propose(["e"], [3], [0.0], [0])) == [greedy_chain(s, "e", 3)]


@pytest.mark.parametrize("rows_per_forward", [1, 32])
def test_long_prompts_cut_into_rows_and_forwards(tmp_path, monkeypatch, rows_per_forward):
    """New prompts of several rows of PREFILL_ROW tokens, fed all rows in one forward or one row a forward (a
    prompt cut across forwards), leave the head's cache as the whole-prompt reference does: the chains
    drafted from it are the reference's."""
    monkeypatch.setattr(proposer_module, "PREFILL_GRAPH_TOKENS", rows_per_forward * PREFILL_ROW)
    s = Setup(tmp_path, "eagle3", max_context=256)
    for rid, n in [("a", 150), ("b", 3), ("c", 66)]:  # 3 rows, 1 row, 2 rows (past the first-step width)
        s.add(rid, n)
    order, ks = ["a", "b", "c"], [4, 2, 3]
    p = s.proposer.propose(order, ks, [0.0] * 3, [0] * 3)
    assert split(p) == [greedy_chain(s, r, k) for r, k in zip(order, ks, strict=True)]


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_sampled_drafts_ship_the_exact_q_they_were_drawn_from(tmp_path, arch):
    s = Setup(tmp_path, arch)
    for rid, n in [("a", 6), ("b", 8), ("c", 4)]:
        s.add(rid, n)
    temps, top_k, order, ks = [0.7, 0.0, 1.3], [5, 0, 3], ["a", "b", "c"], [3, 2, 4]
    p = s.proposer.propose(order, ks, temps, top_k)
    assert not p.probs.is_dense
    indices, values = p.probs.indices, p.probs.values
    assert values.dtype == torch.float32 and indices.shape == (sum(ks), 5)
    row = 0
    for rid, k, t, tk, drafts in zip(order, ks, temps, top_k, split(p), strict=True):
        logits = s.chain_logits(rid, drafts)[:k]
        for j in range(k):
            idx, q = indices[row], values[row]
            assert drafts[j] == int(idx[0]) if t == 0 else drafts[j] in idx[q > 0].tolist()
            if t == 0:
                assert q.tolist() == [1.0] + [0.0] * 4 and idx[1:].tolist() == [-1] * 4
            else:  # exactly the renormalised top-tk of softmax(logits / t)
                top = torch.softmax(logits[j] / t, -1).topk(tk)
                want = torch.zeros(VOCAB).index_put_(
                    (s.to_target(top.indices),), top.values / top.values.sum()
                )
                used = idx >= 0  # -1 marks unused slots (past top_k, or q that underflowed to 0)
                got = torch.zeros(VOCAB).index_put_((idx[used],), q[used])
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
                assert q[~used].abs().sum() == 0 and idx[tk:].tolist() == [-1] * (5 - tk)
            row += 1


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_untruncated_rows_ship_dense_float32_q(tmp_path, arch):
    s = Setup(tmp_path, arch)
    s.add("a", 5)
    s.add("b", 7)
    p = s.proposer.propose(["a", "b"], [2, 3], [0.9, 0.5], [0, 4])
    assert p.probs.is_dense
    q = p.probs.probs
    assert q.dtype == torch.float32 and q.shape == (5, VOCAB)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    drafts = split(p)
    ref_a = torch.softmax(s.chain_logits("a", drafts[0])[:2] / 0.9, -1)
    if arch == "eagle1":
        torch.testing.assert_close(q[:2], ref_a, atol=1e-5, rtol=1e-4)
    else:  # draft-vocabulary q scattered onto its target ids; 0 elsewhere
        torch.testing.assert_close(
            q[:2, s.to_target(torch.arange(ref_a.shape[1]))], ref_a, atol=1e-5, rtol=1e-4
        )
        assert int((q[:2] > 0).sum(-1).max()) <= ref_a.shape[1]
    assert all(float(q[i, t]) > 0 for i, t in enumerate(drafts[0] + drafts[1]))
    assert int((q[2:] > 0).sum(-1).max()) <= 4  # b's top-4 rows, scattered


def test_sample_drafts_frequencies_follow_q():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).expand(40000, 6)
    temperature = torch.full((40000,), 0.8)
    for tk, mode in [(0, "full"), (3, "full"), (3, "top_k")]:
        sample = sample_drafts(logits, temperature, torch.full((40000,), tk), max_top_k=4, mode=mode)
        q = torch.zeros(6).index_add_(0, sample.top_idx[0], sample.top_q[0]) if tk else sample.full_q[0]
        freq = torch.bincount(sample.tokens, minlength=6).float() / 40000
        assert (freq - q).abs().max() < 0.012  # ~5 sigma at n = 40000
        assert float(q.sum()) == pytest.approx(1.0, abs=1e-6)


def test_context_end_clips_drafts_and_bad_input_raises(tmp_path):
    s = Setup(tmp_path, "eagle1", max_context=12)
    s.add("a", 10)  # 9 pairs cached after the first step; drafts may write 3 more positions
    p = s.proposer.propose(["a"], [4], [0.0], [0])
    assert p.num_drafts.tolist() == [4] and split(p) == [greedy_chain(s, "a", 4)]
    s.update("a", 2)  # 11 pairs: only one draft fits (it writes no position)
    p = s.proposer.propose(["a"], [4], [0.0], [0])
    assert p.num_drafts.tolist() == [2]
    with pytest.raises(ProposerError, match="exceeds the drafter context"):
        s.update("a", 2)
    with pytest.raises(ProposerError, match="unknown request 'zz'"):
        s.proposer.propose(["zz"], [1], [0.0], [0])
    with pytest.raises(ProposerError, match="no new tokens"):
        s.proposer.propose(["a"], [1], [0.0], [0])
    with pytest.raises(ProposerError, match="features of shape"):
        s.proposer.add("b", [1, 2, 3], torch.zeros(3, s.head.config.feature_dim))
    with pytest.raises(ProposerError, match="num_drafts 5"):
        s.proposer.propose(["a"], [5], [0.0], [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_cuda_graph_replay_matches_eager(tmp_path, arch):
    (tmp_path / "g").mkdir()
    (tmp_path / "e").mkdir()
    graph = Setup(tmp_path / "g", arch, device="cuda", max_requests=20)
    eager = Setup(tmp_path / "e", arch, device="cuda", max_requests=20, cuda_graphs=False)
    assert graph.proposer.graphs and not eager.proposer.graphs
    lengths = [3, 40, 5, 17, 2, 9, 11, 30, 4, 6, 8, 12, 3]  # 13 requests: pads to the 16 graph
    for s in (graph, eager):
        for i, n in enumerate(lengths):
            s.add(f"r{i}", n)

    def both(order, ks, temps, top_k):
        pg = graph.proposer.propose(order, ks, temps, top_k)
        pe = eager.proposer.propose(order, ks, temps, top_k)
        assert pg.num_drafts.tolist() == pe.num_drafts.tolist()
        return pg, pe

    order = [f"r{i}" for i in range(13)]
    ks = [i % (MAX_DRAFTS + 1) for i in range(13)]
    pg, pe = both(order, ks, [0.0] * 13, [0] * 13)
    assert pg.token_ids.tolist() == pe.token_ids.tolist()
    for i in range(13):  # very different lengths advance, some leave, batch 4 hits a captured size
        for s in (graph, eager):
            s.update(f"r{i}", 1 + i % 3)
    for i in (1, 7, 3):
        graph.proposer.free(f"r{i}")
        eager.proposer.free(f"r{i}")
    order = ["r0", "r2", "r5", "r9"]
    pg, pe = both(order, [4, 4, 2, 3], [0.0] * 4, [0] * 4)
    assert pg.token_ids.tolist() == pe.token_ids.tolist()
    # Sampled drafts draw different random numbers; the q of shared draft prefixes must agree.
    for s in (graph, eager):
        for rid in order:
            s.update(rid, 2)
    pg, pe = both(order, [3, 3, 3, 3], [0.8] * 4, [0, 0, 0, 0])
    qg, qe = pg.probs.probs, pe.probs.probs
    first = torch.arange(4, device="cuda") * 3  # each row's first draft has the same context in both
    torch.testing.assert_close(qg[first], qe[first], atol=1e-4, rtol=1e-3)
    assert qg.dtype == torch.float32
    for s in (graph, eager):  # the top-K graph ships sparse q
        for rid in order:
            s.update(rid, 1)
    pg, pe = both(order, [2, 2, 2, 2], [0.8, 0.0, 0.5, 0.8], [4, 0, 6, 2])
    assert not pg.probs.is_dense and pg.probs.values.shape == (8, 6)
    torch.testing.assert_close(
        pg.probs.values[first[[0, 2, 3]] // 3 * 2], pe.probs.values[first[[0, 2, 3]] // 3 * 2]
    )
    assert pg.probs.indices[2:4, 1:].eq(-1).all()  # greedy row: one-hot
