"""Rejection sampler: Philox parity, reference semantics, losslessness statistics, kernel == reference.

The Triton kernel runs on CPU under TRITON_INTERPRET=1, which must be set before triton is first imported;
when another test module imported triton first, the interpreter tests re-run in a fresh process.
The statistical tests also run deliberately broken samplers (defined only here) and assert that the same
check rejects them, so the check is known to discriminate the bugs it guards against.
"""

import itertools
import math
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from specwire.kernels import rejection_sampler_triton  # noqa: E402
from specwire.kernels.philox import philox4x32, philox_uniforms  # noqa: E402
from specwire.kernels.rejection_sampler import (  # noqa: E402
    DraftProbs,
    SamplerInputError,
    prepare_columns,
    rejection_sample,
    sample_with,
)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# The interpreter evaluates masked-off lanes too (log(0), -inf - -inf): IEEE results, discarded by the kernel.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
INTERPRETING = isinstance(rejection_sampler_triton._rejection_kernel, InterpretedFunction)
on_interpreter = pytest.mark.skipif(not INTERPRETING,
                                    reason="triton is compiled in this process (see module doc)")


# ------------------------------------------------------------------------------------------------ batches


def make_batch(B: int, V: int, max_k: int, mode: str, seed: int = 0, greedy_frac: float = 0.3,
               filter_frac: float = 0.0, K: int = 8, invalid_frac: float = 0.05, synthetic: bool = False,
               fixed_k: bool = False, device: str = "cpu") -> dict:
    """A random mixed batch: per-request k in 0..max_k (or all max_k), greedy and random rows, optional
    top-k/top-p rows. Large tensors are made on `device`, per-request ones on the CPU.

    Drafts are sampled from the draft distribution that is passed (dense q, top-K renormalised q, or the
    argmax for mode "none"), with some ids replaced by -1 or V to exercise invalid drafts.
    """
    g, gd = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)
    num_drafts = torch.full((B,), max_k) if fixed_k else torch.randint(0, max_k + 1, (B,), generator=g)
    D = int(num_drafts.sum())
    logits = torch.randn(D + B, V, generator=gd, device=device) * 3
    noise = torch.randn(D, V, generator=gd, device=device) * 1.5
    q = torch.softmax(logits[_draft_rows(num_drafts).to(device)] + noise, dim=1)
    draft_probs = None
    if mode == "dense":
        draft_probs = DraftProbs.dense(q)
    elif mode == "sparse":
        values, indices = q.topk(min(K, V), dim=1)
        values = values / values.sum(1, keepdim=True)
        q = torch.zeros_like(q).scatter(1, indices, values)
        draft_probs = DraftProbs.sparse(indices, values)
    sampled = mode != "none" and D > 0
    draft_ids = torch.multinomial(q, 1, generator=gd).squeeze(1) if sampled else q.argmax(1)
    bad = (torch.rand(D, generator=g) < invalid_frac).to(device)
    draft_ids[bad] = torch.where(torch.rand(D, generator=g) < 0.5, -1, V).to(device)[bad]
    random_rows = torch.rand(B, generator=g) >= greedy_frac
    temperature = torch.where(random_rows, 0.3 + 1.5 * torch.rand(B, generator=g), 0.0)
    filtered = torch.rand(B, generator=g) < filter_frac
    some_k, some_p = torch.randint(1, V + 1, (B,), generator=g), 0.2 + 0.8 * torch.rand(B, generator=g)
    return dict(
        target_logits=logits, draft_token_ids=draft_ids, num_drafts=num_drafts.int(), draft_probs=draft_probs,
        temperature=temperature, top_k=torch.where(filtered & (torch.rand(B, generator=g) < 0.5), some_k, 0),
        top_p=torch.where(filtered & (torch.rand(B, generator=g) < 0.7), some_p, 1.0),
        seed=torch.randint(0, 2**62, (B,), generator=g),
        positions=torch.randint(0, 100_000, (B,), generator=g),
        synthetic_acceptance=torch.rand(max(max_k, 1), generator=g) if synthetic else None,
    )


def _draft_rows(num_drafts: torch.Tensor) -> torch.Tensor:
    """Target row of each draft (row j of request b checks draft j)."""
    first_row = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    return torch.cat([first_row[b] + torch.arange(int(k)) for b, k in enumerate(num_drafts)]).long()


def count_mismatches(batch: dict) -> tuple[int, int]:
    """(requests whose output differs between the Triton kernel and the reference, rows decided)."""
    ref = rejection_sample(**batch, backend="torch")
    out = rejection_sample(**batch, backend="triton")
    differs = (ref.tokens != out.tokens).any(1) | (ref.num_tokens != out.num_tokens)
    return int(differs.sum()), batch["target_logits"].shape[0]


# ------------------------------------------------------------------------------------------------- Philox


def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors (Triton's generator is the same function)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, (k0, k1), expected in cases:
        seed = torch.tensor(k0 | (k1 << 32) if k1 < 2**31 else (k0 | (k1 << 32)) - 2**64)
        words = philox4x32(seed, *(torch.tensor(c) for c in counter))
        assert tuple(int(w) for w in words) == expected


@triton.jit
def _philox_probe(out_ptr, seed, c1, c2, c3, N: tl.constexpr):
    c0 = tl.arange(0, N).to(tl.int32) * 977 + 3
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = tl.philox(seed, c0, zero + c1, zero + c2, zero + c3)
    i = tl.arange(0, N) * 4
    tl.store(out_ptr + i, tl.uint_to_uniform_float(w0))
    tl.store(out_ptr + i + 1, tl.uint_to_uniform_float(w1))
    tl.store(out_ptr + i + 2, tl.uint_to_uniform_float(w2))
    tl.store(out_ptr + i + 3, tl.uint_to_uniform_float(w3))


def philox_parity(device: str) -> None:
    for seed in (0, 12345, -7, 2**40 + 5, -(2**62)):
        for c1 in (0, 77, 2**31 - 1):
            out = torch.empty(4 * 256, device=device)
            _philox_probe[(1,)](out, seed, c1, 1, 0x53505752, N=256)
            c0 = torch.arange(256, device=device) * 977 + 3
            ref = philox_uniforms(torch.tensor(seed, device=device), c0, torch.tensor(c1), torch.tensor(1),
                                  torch.tensor(0x53505752)).reshape(-1)
            assert torch.equal(out, ref), (seed, c1)


@on_interpreter
def test_philox_matches_triton_cpu():
    philox_parity("cpu")


# ------------------------------------------------------------------------------------- reference semantics


def _expected_p(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target distribution written out independently: sort, cut top-k, cut top-p, renormalise."""
    z = logits.double() / temperature
    order = z.argsort(descending=True)
    probs = torch.softmax(z[order], 0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    probs = torch.where(keep, probs, 0) / probs[keep].sum()
    mass_before = 0.0
    for i in range(len(probs)):
        if not keep[i] or mass_before >= top_p:
            keep[i] = False
        mass_before += probs[i].item()
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[keep] / probs[keep].sum()
    return out


def _one_request(logits: torch.Tensor, drafts: list[int], temperature: float, seed: int = 1, pos: int = 0,
                 draft_probs: DraftProbs | None = None, backend: str = "torch", top_k: int = 0,
                 top_p: float = 1.0):
    out = rejection_sample(
        logits, torch.tensor(drafts, dtype=torch.long), torch.tensor([len(drafts)]), draft_probs,
        torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([seed]),
        torch.tensor([pos]), backend=backend)
    return out.tokens[0, : int(out.num_tokens[0])].tolist()


BACKENDS = ["torch", pytest.param("triton", marks=on_interpreter)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_accepts_while_draft_is_argmax(backend):
    logits = torch.full((4, 50), -1.0)
    target = [7, 3, 9, 11]
    logits[torch.arange(4), target] = 5.0
    logits[1, 2] = 5.0  # a tie at row 1: the lowest index (2) is the argmax
    assert _one_request(logits, [7, 2, 9], 0.0, backend=backend) == [7, 2, 9, 11]
    assert _one_request(logits, [7, 3, 9], 0.0, backend=backend) == [7, 2]
    assert _one_request(logits, [1, 2, 9], 0.0, backend=backend) == [7]


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_draft_ids_reject_and_sample_from_p(backend):
    logits = torch.full((3, 40), -30.0)
    logits[:, 5] = 10.0  # p is (almost) one-hot at 5 for every row
    for drafts in ([-1, 5], [40, 5], [123456, 5]):
        assert _one_request(logits, drafts, 1.0, backend=backend) == [5]
        assert _one_request(logits, drafts, 0.0, backend=backend) == [5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_probabilities(backend):
    logits = torch.zeros(2, 30)
    logits[0, 4] = float("-inf")  # p(4) = 0 at row 0: draft 4 is always rejected
    # q equals p elsewhere, so the residual has no mass after rounding: the token then comes from p, never 4.
    q = torch.full((1, 30), 1 / 29.0)
    q[0, 4], q[0, 6] = 0.0, 1 / 29.0
    for seed in range(6):
        tokens = _one_request(logits, [4], 1.0, seed=seed, draft_probs=DraftProbs.dense(q), backend=backend)
        assert len(tokens) == 1 and tokens[0] != 4
    q0 = torch.zeros(1, 30)
    q0[0, 0] = 1.0  # q(6) = 0 while p(6) > 0: min(1, p/q) = 1, always accepted
    for seed in range(6):
        tokens = _one_request(logits, [6], 1.0, seed=seed, draft_probs=DraftProbs.dense(q0), backend=backend)
        assert tokens[0] == 6


def _target_only_rows(batch: dict, backend: str) -> torch.Tensor:
    """The target-only sample of every target row: each row alone, at its own position, no drafts."""
    nd = batch["num_drafts"].long()
    request = torch.repeat_interleave(torch.arange(nd.numel()), nd + 1)
    first_row = torch.cumsum(nd + 1, 0) - (nd + 1)
    index = torch.arange(request.numel()) - first_row[request]
    R = request.numel()
    out = rejection_sample(
        batch["target_logits"], torch.zeros(0, dtype=torch.long), torch.zeros(R, dtype=torch.int32), None,
        *(batch[name][request] for name in ("temperature", "top_k", "top_p", "seed")),
        batch["positions"][request] + index, backend=backend)
    return out.tokens[:, 0].cpu()


def one_hot_drafts_emit_target_only_samples(backend: str, V: int, device: str = "cpu") -> None:
    """Whatever the drafts (here most of them the target-only token, the rest random or invalid ids), a
    request emits the target-only samples of its positions, and accepts exactly the leading drafts that
    equal them."""
    for seed in range(3):
        batch = make_batch(12, V, 4, "none", seed=seed, greedy_frac=0.25, filter_frac=0.4, device=device)
        expected = _target_only_rows(batch, backend)
        nd = batch["num_drafts"].long()
        draft_rows = _draft_rows(nd)
        g = torch.Generator().manual_seed(seed)
        random_ids = torch.randint(-1, V + 1, (draft_rows.numel(),), generator=g)
        match = torch.rand(draft_rows.numel(), generator=g) < 0.6
        batch["draft_token_ids"] = torch.where(match, expected[draft_rows], random_ids)
        out = rejection_sample(**batch, backend=backend, defer_check=True).token_lists()
        first_row, first_draft = torch.cumsum(nd + 1, 0) - (nd + 1), torch.cumsum(nd, 0) - nd
        for b in range(nd.numel()):
            drafts = batch["draft_token_ids"][first_draft[b]: first_draft[b] + nd[b]].tolist()
            target = expected[first_row[b]: first_row[b] + nd[b] + 1].tolist()
            accepted = next((j for j in range(len(drafts)) if drafts[j] != target[j]), len(drafts))
            assert out[b] == target[: accepted + 1], (seed, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_drafts_emit_exactly_the_target_only_sample(backend):
    one_hot_drafts_emit_target_only_samples(backend, V=50)


def test_thresholds_keep_exactly_top_k_and_top_p():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(1, 12, generator=g) * 2
        top_k, top_p = int(torch.randint(0, 13, (1,), generator=g)), float(torch.rand(1, generator=g))
        temperature = 0.7
        expected_support = _expected_p(logits[0], temperature, top_k, top_p) > 0
        N, zeros = 400, torch.zeros(400, dtype=torch.long)
        full = torch.full
        out = rejection_sample(logits.repeat(N, 1), zeros[:0], zeros.int(), None, full((N,), temperature),
                               full((N,), top_k), full((N,), top_p), torch.arange(N), zeros)
        support = set(out.tokens[:, 0].tolist())
        assert support <= set(torch.nonzero(expected_support).squeeze(1).tolist())
        assert len(support) == int(expected_support.sum())


def test_batch_layout_rows_and_padding():
    """[2, 0, 1] drafts: rows [a0 a1 a_bonus, b_bonus, c0 c_bonus]; output padded with -1."""
    V = 20
    logits = torch.full((6, V), -5.0)
    argmax = [1, 2, 3, 4, 5, 6]
    logits[torch.arange(6), argmax] = 5.0
    out = rejection_sample(logits, torch.tensor([1, 2, 9]), torch.tensor([2, 0, 1]), None, torch.zeros(3),
                           torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3, dtype=torch.long),
                           torch.zeros(3, dtype=torch.long))
    assert out.tokens.tolist() == [[1, 2, 3], [4, -1, -1], [5, -1, -1]]  # c's draft 9 is not argmax 5
    assert out.num_tokens.tolist() == [3, 1, 1]


# ---------------------------------------------------------------------------------------- losslessness


def _chi2_critical(dof: int, z: float = 4.75) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 4.75 is a one-sided tail of about 1e-6."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _fits(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Chi-square goodness of fit of token counts to p (cells with tiny expectation pooled)."""
    n = counts.sum()
    expected = p.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        if obs[-1] > 0:
            return False
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return stat < _chi2_critical(max(len(exp) - 1, 1))


def _emitted(sampler, p_logits: torch.Tensor, q: torch.Tensor, mode: str, N: int, seed: int,
             temperature: float) -> list[torch.Tensor]:
    """Counts of emitted tokens per position over N requests that draft k = len(q) tokens from q."""
    k, V = q.shape
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], 1)
    if mode == "none":
        drafts = q.argmax(1).expand(N, k)
    tokens, num = sampler(p_logits, drafts, q, mode, temperature, seed)
    return [torch.bincount(tokens[num > j, j], minlength=V) for j in range(k + 1)]


def _real_sampler(p_logits, drafts, q, mode, temperature, seed, draft_probs_override="keep", backend="torch",
                  device="cpu"):
    N, k = drafts.shape
    p_logits, drafts, q = p_logits.to(device), drafts.to(device), q.to(device)
    q_rows = q.repeat(N, 1)
    if mode == "dense":
        draft_probs = DraftProbs.dense(q_rows)
    elif mode == "sparse":
        support = (q > 0).sum(1).max()
        values, indices = q.topk(int(support), dim=1)
        draft_probs = DraftProbs.sparse(indices.repeat(N, 1), values.repeat(N, 1))
    else:
        draft_probs = None
    if draft_probs_override is None:
        draft_probs = None
    out = rejection_sample(p_logits.repeat(N, 1), drafts.reshape(-1), torch.full((N,), k), draft_probs,
                           torch.full((N,), temperature), torch.zeros(N, dtype=torch.long), torch.ones(N),
                           torch.arange(N) * 7919 + seed, torch.zeros(N, dtype=torch.long), backend=backend)
    return out.tokens.cpu(), out.num_tokens.cpu()


def _inverse_cdf_sampler(p_logits, drafts, q, mode, temperature, seed, q_in_ratio: bool = True,
                         renormalise: bool = True):
    """An independent textbook sampler (inverse CDF), and the broken variants the checks must reject.

    q_in_ratio=False: seed 001's bug, q(x) taken as 1 in the acceptance test (the residual still uses q).
    renormalise=False: the residual max(0, p - q) is sampled without dividing by its mass.
    """
    N, k = drafts.shape
    g = torch.Generator().manual_seed(seed + 1)
    p = torch.softmax(p_logits.double() / temperature, dim=1)
    qd = q.double() if mode != "none" else torch.nn.functional.one_hot(drafts[0], p.shape[1]).double()
    tokens = torch.full((N, k + 1), -1, dtype=torch.long)
    alive = torch.ones(N, dtype=torch.bool)
    num = torch.zeros(N, dtype=torch.long)
    for j in range(k + 1):
        if j == k:
            sampled = torch.multinomial(p[j], N, replacement=True, generator=g)
            tokens[alive, j], num[alive] = sampled[alive], j + 1
            break
        x = drafts[:, j]
        accept = torch.rand(N, generator=g, dtype=torch.float64) * (qd[j, x] if q_in_ratio else 1) < p[j, x]
        residual = torch.clamp(p[j] - qd[j], min=0)
        if renormalise:
            residual = residual / residual.sum()
        cdf = residual.cumsum(0)
        u = torch.rand(N, generator=g, dtype=torch.float64)
        recovered = torch.searchsorted(cdf, u).clamp(max=p.shape[1] - 1)
        tokens[alive, j] = torch.where(accept, x, recovered)[alive]
        num[alive & ~accept] = j + 1
        alive &= accept
    return tokens, num


def _lossless(sampler, mode: str, N: int = 10_000, trials: int = 2, V: int = 10, k: int = 3,
              temperature: float = 1.0) -> bool:
    """Every position of every trial (fresh random p and q, fresh seeds) fits p."""
    for trial in range(trials):
        g = torch.Generator().manual_seed(100 + trial)
        p_logits = torch.randn(k + 1, V, generator=g) * 1.5
        q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=1)
        if mode == "sparse":  # the drafter's top-4, renormalised: exactly the q it samples from
            values, indices = q.topk(4, dim=1)
            q = torch.zeros_like(q).scatter(1, indices, values / values.sum(1, keepdim=True))
        p = torch.softmax(p_logits.double() / temperature, dim=1)
        counts = _emitted(sampler, p_logits, q, mode, N, seed=trial * 1000, temperature=temperature)
        if not all(_fits(counts[j], p[j]) for j in range(k + 1)):
            return False
    return True


@pytest.mark.parametrize("mode", ["dense", "sparse", "none"])
def test_lossless_emitted_tokens_follow_p(mode):
    assert _lossless(_real_sampler, mode)


def test_lossless_with_temperature():
    assert _lossless(_real_sampler, "dense", temperature=0.6, trials=1)


def test_total_variation_shrinks_with_samples():
    g = torch.Generator().manual_seed(5)
    V, k = 10, 2
    p_logits = torch.randn(k + 1, V, generator=g)
    q = torch.softmax(torch.randn(k, V, generator=g), dim=1)
    p = torch.softmax(p_logits.double(), dim=1)
    for N in (2_000, 8_000, 32_000):
        counts = _emitted(_real_sampler, p_logits, q, "dense", N, seed=N, temperature=1.0)
        for j in range(k + 1):
            tv = 0.5 * (counts[j].double() / counts[j].sum() - p[j]).abs().sum().item()
            assert tv < 2.5 * math.sqrt(V / counts[j].sum().item()), (N, j, tv)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_statistical_check_accepts_textbook_and_rejects_broken_samplers(mode):
    def q_taken_as_one(*args):
        return _inverse_cdf_sampler(*args, q_in_ratio=False)

    def unnormalised_residual(*args):
        return _inverse_cdf_sampler(*args, renormalise=False)

    assert _lossless(_inverse_cdf_sampler, mode)
    assert not _lossless(q_taken_as_one, mode)
    assert not _lossless(unnormalised_residual, mode)


def _acceptance_rate(draft_probs_reach_sampler: bool, N: int = 40_000) -> tuple[float, float, float]:
    """(measured rate of accepting draft 0, sum min(p, q), sum p q) for drafts sampled from a dense q."""
    g = torch.Generator().manual_seed(9)
    V = 10
    p_logits = torch.randn(2, V, generator=g)
    q = torch.softmax(torch.randn(1, V, generator=g), dim=1)
    drafts = torch.multinomial(q[0], N, replacement=True, generator=g)[:, None]
    override = "keep" if draft_probs_reach_sampler else None
    _, num = _real_sampler(p_logits, drafts, q, "dense", 1.0, 3, draft_probs_override=override)
    p = torch.softmax(p_logits[0].double(), 0)
    return (num == 2).double().mean().item(), torch.minimum(p, q[0]).sum().item(), (p * q[0]).sum().item()


def test_acceptance_rate_uses_draft_probs():
    """Seed 001: without q the sampler stays lossless (one-hot drafts: it emits the target-only sample y and
    accepts iff x == y, which for x ~ q happens with probability sum p q, not sum min(p, q)). The rate check
    tells the two apart."""
    N = 40_000
    for reach in (True, False):
        rate, with_q, without_q = _acceptance_rate(reach, N)
        expected = with_q if reach else without_q
        sigma = math.sqrt(expected * (1 - expected) / N)
        assert abs(rate - expected) < 5 * sigma
        assert abs(with_q - without_q) > 20 * sigma  # the two hypotheses are far apart


def test_synthetic_mode_hits_requested_rates():
    N, rates = 8_000, torch.tensor([0.9, 0.6, 0.3])
    batch = make_batch(N, 16, 3, "dense", seed=4, greedy_frac=0.5, invalid_frac=0.0, synthetic=True)
    batch["num_drafts"] = torch.full((N,), 3, dtype=torch.int32)
    batch["target_logits"] = torch.randn(4 * N, 16)
    batch["draft_token_ids"] = torch.randint(0, 16, (3 * N,))
    batch["draft_probs"] = DraftProbs.dense(torch.softmax(torch.randn(3 * N, 16), 1))
    batch["synthetic_acceptance"] = rates
    accepted = rejection_sample(**batch).num_tokens - 1
    for j, rate in enumerate(rates.tolist()):
        reached = (accepted >= j).sum().item()
        measured = (accepted > j).sum().item() / reached
        assert abs(measured - rate) < 5 * math.sqrt(rate * (1 - rate) / reached), (j, measured)


# -------------------------------------------------------------------------------- determinism and errors


def _seeded_output(batch: dict, order: list[int], backend: str) -> dict[int, list[int]]:
    """Outputs per original request when the batch is re-assembled in the given order."""
    nd = batch["num_drafts"].long()
    first_row = torch.cumsum(nd + 1, 0) - (nd + 1)
    first_draft = torch.cumsum(nd, 0) - nd
    rows = torch.cat([first_row[b] + torch.arange(int(nd[b]) + 1) for b in order])
    drafts = torch.cat([first_draft[b] + torch.arange(int(nd[b])) for b in order])
    q = batch["draft_probs"]
    sub = dict(batch, target_logits=batch["target_logits"][rows], num_drafts=nd[order].int(),
               draft_token_ids=batch["draft_token_ids"][drafts],
               draft_probs=DraftProbs.dense(q.probs[drafts]))
    for name in ("temperature", "top_k", "top_p", "seed", "positions"):
        sub[name] = batch[name][order]
    out = rejection_sample(**sub, backend=backend)
    return {b: out.tokens[i, : int(out.num_tokens[i])].tolist() for i, b in enumerate(order)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_request_repeats_in_any_batch(backend):
    batch = make_batch(6, 60, 3, "dense", seed=11, greedy_frac=0.0, filter_frac=0.5, invalid_frac=0.0)
    alone = {b: _seeded_output(batch, [b], backend)[b] for b in (0, 3)}
    mixed = _seeded_output(batch, [5, 3, 1, 0], backend)
    assert mixed[0] == alone[0] and mixed[3] == alone[3]
    reseeded = dict(batch, seed=batch["seed"] + 1)
    changed = [_seeded_output(reseeded, [b], backend)[b] != alone[b] for b in (0, 3)]
    assert any(changed), "a new seed should change some sampled output"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise(backend, bad):
    batch = make_batch(3, 40, 2, "dense", seed=2)
    batch["target_logits"][1, 7] = bad
    with pytest.raises(SamplerInputError, match="rows"):
        rejection_sample(**batch, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_draft_probs_raise(backend):
    batch = make_batch(3, 40, 2, "sparse", seed=2, greedy_frac=0.0, invalid_frac=0.0)
    batch["draft_probs"].values[0, 0] = float("nan")
    with pytest.raises(SamplerInputError, match="rows"):
        rejection_sample(**batch, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_logits_are_fine_but_an_empty_row_raises(backend):
    logits = torch.randn(2, 30)
    logits[:, :10] = float("-inf")
    for seed in range(4):
        assert _one_request(logits, [3], 1.0, seed=seed, backend=backend)[-1] >= 10
    logits[1] = float("-inf")
    with pytest.raises(SamplerInputError, match="finite"):
        _one_request(logits, [3], 1.0, backend=backend)


def test_bad_arguments_raise_one_line_errors():
    batch = make_batch(3, 40, 2, "dense", seed=2)
    cases = {
        "temperature": dict(temperature=torch.tensor([1.0, -1.0, 0.0])),
        "top_p": dict(top_p=torch.tensor([1.0, 0.0, 1.0])),
        "top_k": dict(top_k=torch.tensor([-2, 0, 0])),
        "rows": dict(target_logits=batch["target_logits"][1:]),
        "float32": dict(draft_probs=DraftProbs.dense(batch["draft_probs"].probs.double())),
        "draft_token_ids": dict(draft_token_ids=batch["draft_token_ids"][1:]),
        "synthetic_acceptance": dict(synthetic_acceptance=torch.tensor([1.5, 0.2])),
    }
    for match, change in cases.items():
        with pytest.raises(SamplerInputError, match=match) as err:
            rejection_sample(**{**batch, **change})
        assert "\n" not in str(err.value)


def test_target_only_sampling_is_argmax_or_follows_p():
    V, N = 12, 10_000
    logits = torch.randn(1, V).repeat(N, 1)
    zeros = torch.zeros(N, dtype=torch.long)
    args = (logits, torch.zeros(0, dtype=torch.long), torch.zeros(N, dtype=torch.int32), None)
    greedy = rejection_sample(*args, torch.zeros(N), zeros, torch.ones(N), torch.arange(N), zeros)
    assert greedy.tokens.shape == (N, 1) and (greedy.tokens[:, 0] == logits[0].argmax()).all()
    sampled = rejection_sample(*args, torch.full((N,), 0.8), torch.full((N,), 5), torch.full((N,), 0.9),
                               torch.arange(N), zeros)
    assert _fits(torch.bincount(sampled.tokens[:, 0], minlength=V), _expected_p(logits[0], 0.8, 5, 0.9))


# ------------------------------------------------------------------------------------- deferred check


def _eager_lists(out) -> list[list[int]]:
    return [out.tokens[b, : int(out.num_tokens[b])].tolist() for b in range(out.tokens.shape[0])]


def mixed_batches(device: str = "cpu"):
    """Random batches: one-hot, dense and sparse q; greedy, random and mixed rows; k 0..4; some filtering."""
    for i, (mode, greedy) in enumerate(itertools.product(("none", "dense", "sparse"), (0.0, 0.5, 1.0))):
        yield make_batch(1 + 2 * (i % 3), 300, i % 5, mode, seed=50 + i, greedy_frac=greedy,
                         filter_frac=0.3 * (i % 2), fixed_k=i % 4 == 0, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_check_equals_eager(backend):
    for batch in mixed_batches():
        eager = rejection_sample(**batch, backend=backend)
        deferred = rejection_sample(**batch, backend=backend, defer_check=True)
        assert deferred.token_lists() == _eager_lists(eager)
        assert torch.equal(deferred.packed, eager.packed)


@on_interpreter
@pytest.mark.parametrize("fault", ["nan logits", "negative q"])
def test_deferred_check_raises_at_token_lists(fault):
    batch = make_batch(3, 40, 2, "dense", seed=2, greedy_frac=0.0, invalid_frac=0.0, fixed_k=True)
    if fault == "nan logits":
        batch["target_logits"][4, 7] = float("nan")  # a row of request 1
    else:
        batch["draft_probs"].probs[2] = -batch["draft_probs"].probs[2]  # request 1's first draft
    out = rejection_sample(**batch, backend="triton", defer_check=True)  # no raise: nothing was read
    assert out.num_tokens.tolist()[1] == -1 and min(out.num_tokens.tolist()[::2]) >= 1
    with pytest.raises(SamplerInputError, match=r"requests \[1\]"):
        out.token_lists()
    with pytest.raises(SamplerInputError, match="rows"):
        rejection_sample(**batch, backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_dtypes_and_columns_agree(backend):
    """int32 draft ids / sparse indices and int32 or float64 columns give the same tokens as int64/float32."""
    for batch in mixed_batches():
        out = rejection_sample(**batch, backend=backend, defer_check=True).token_lists()
        q = batch["draft_probs"]
        narrow = dict(batch, draft_token_ids=batch["draft_token_ids"].int(), top_k=batch["top_k"].int(),
                      temperature=batch["temperature"].double(), positions=batch["positions"].int())
        if q is not None and not q.is_dense:
            narrow["draft_probs"] = DraftProbs.sparse(q.indices.int(), q.values)
        assert rejection_sample(**narrow, backend=backend, defer_check=True).token_lists() == out


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_interpreter)])
def test_columns_prepared_once_serve_every_round(backend):
    """A serving loop prepares a batch's per-request columns once (prepare_columns) and samples round after
    round with new logits, drafts and positions (sample_with): each round gives what rejection_sample gives
    from scratch, filtered and seeded rows included. Columns that do not fit the round are refused."""
    first = make_batch(6, 50, 3, "sparse", seed=4, filter_frac=0.5, fixed_k=True)
    columns = prepare_columns(first["num_drafts"], first["temperature"], first["top_k"], first["top_p"],
                              first["seed"], 50, torch.device("cpu"))
    for seed in range(4):  # the same columns, new rounds (make_batch draws the columns from other streams)
        again = make_batch(6, 50, 3, "sparse", seed=10 + seed, filter_frac=0.5, fixed_k=True)
        round_ = {**first, **{k: again[k] for k in ("target_logits", "draft_token_ids", "draft_probs")},
                  "positions": first["positions"] + 7 * seed}
        want = rejection_sample(**round_, backend=backend, defer_check=True).token_lists()
        got = sample_with(columns, round_["target_logits"], round_["draft_token_ids"], round_["draft_probs"],
                          round_["positions"], backend=backend, defer_check=True).token_lists()
        assert got == want
    with pytest.raises(SamplerInputError, match="prepared for 50 logits"):
        sample_with(columns, torch.randn(24, 51), first["draft_token_ids"], None, first["positions"])
    with pytest.raises(SamplerInputError, match="rows"):
        sample_with(columns, first["target_logits"][1:], first["draft_token_ids"], None, first["positions"])
    with pytest.raises(SamplerInputError, match="positions"):
        sample_with(columns, first["target_logits"], first["draft_token_ids"], None, -first["positions"] - 1)


# ------------------------------------------------------------------------ Triton kernel == reference (CPU)


@on_interpreter
@pytest.mark.parametrize("mode", ["none", "dense", "sparse"])
def test_triton_cpu_matches_reference(mode):
    decisions = mismatches = 0
    for B, V, max_k, seed in ((1, 100, 0, 1), (5, 100, 3, 2), (4, 2500, 2, 3)):
        m, d = count_mismatches(make_batch(B, V, max_k, mode, seed=seed, filter_frac=0.4))
        mismatches, decisions = mismatches + m, decisions + d
    m, d = count_mismatches(make_batch(4, 64, 3, mode, seed=4, synthetic=True))
    assert mismatches + m <= 1e-4 * (decisions + d), f"{mismatches + m} mismatches in {decisions + d} rows"


@on_interpreter
def test_triton_cpu_target_only():
    batch = make_batch(6, 300, 0, "none", seed=8, filter_frac=0.5)
    ref, out = (rejection_sample(**batch, backend=b) for b in ("torch", "triton"))
    assert torch.equal(ref.tokens, out.tokens) and out.tokens.shape == (6, 1)


@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="the interpreter tests run in-process")
def test_triton_kernels_in_a_fresh_interpreter_process():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton or philox"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
