"""Rejection sampler on CUDA: compiled Philox, kernel == reference, losslessness and determinism on the GPU.

The full grid (batch 1..128, k 0..8, V up to 128256) is bench/rejection_sampler_grid.py.
"""

import functools

import pytest
import torch
from specwire.kernels.rejection_sampler import DraftProbs, SamplerInputError, rejection_sample
from test_rejection_sampler import (
    _eager_lists,
    _lossless,
    _real_sampler,
    _seeded_output,
    count_mismatches,
    make_batch,
    mixed_batches,
    one_hot_drafts_emit_target_only_samples,
    philox_parity,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_philox_matches_triton_cuda():
    philox_parity("cuda")


@pytest.mark.parametrize("mode", ["none", "dense", "sparse"])
@pytest.mark.parametrize("V", [100, 8193, 49152])
def test_kernel_matches_reference(mode, V):
    mismatches = decisions = 0
    for seed, (B, max_k) in enumerate(((1, 0), (7, 3), (64, 4), (128, 8))):
        for filter_frac, synthetic in ((0.0, False), (0.4, False), (0.0, True)):
            batch = make_batch(B, V, max_k, mode, seed=seed, filter_frac=filter_frac, K=32,
                               synthetic=synthetic, device="cuda")
            m, d = count_mismatches(batch)
            mismatches, decisions = mismatches + m, decisions + d
    assert mismatches <= 1e-4 * decisions, f"{mismatches} mismatching requests in {decisions} rows"


@pytest.mark.parametrize("mode", ["dense", "sparse", "none"])
def test_kernel_is_lossless(mode):
    assert _lossless(functools.partial(_real_sampler, backend="triton", device="cuda"), mode)


def test_seeded_request_repeats_in_any_batch_cuda():
    batch = make_batch(6, 8193, 3, "dense", seed=11, greedy_frac=0.0, filter_frac=0.5, invalid_frac=0.0,
                       device="cuda")
    alone = {b: _seeded_output(batch, [b], "triton")[b] for b in (0, 3)}
    mixed = _seeded_output(batch, [5, 3, 1, 0], "triton")
    assert mixed[0] == alone[0] and mixed[3] == alone[3]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise_cuda(bad):
    batch = make_batch(3, 8193, 2, "dense", seed=2, device="cuda")
    batch["target_logits"][1, 4097] = bad
    with pytest.raises(SamplerInputError, match="rows"):
        rejection_sample(**batch)


def test_target_only_bfloat16_logits():
    batch = make_batch(32, 49152, 0, "none", seed=5, filter_frac=0.5, device="cuda")
    batch["target_logits"] = batch["target_logits"].bfloat16()
    ref, out = (rejection_sample(**batch, backend=b) for b in ("torch", "triton"))
    assert torch.equal(ref.tokens, out.tokens)


def test_one_hot_drafts_emit_exactly_the_target_only_sample_cuda():
    one_hot_drafts_emit_target_only_samples("triton", V=49152, device="cuda")


def test_deferred_call_never_waits_for_the_device():
    for batch in mixed_batches("cuda"):  # includes top-k/top-p rows: their sort must not sync either
        rejection_sample(**batch, defer_check=True).token_lists()  # compiles the kernel variants first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = rejection_sample(**batch, defer_check=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.token_lists() == _eager_lists(rejection_sample(**batch, backend="torch"))


def test_host_and_device_inputs_agree():
    for batch in mixed_batches("cuda"):
        on_device = rejection_sample(**batch, defer_check=True).token_lists()
        q = batch["draft_probs"]
        q_host = None if q is None else DraftProbs(*(t if t is None else t.cpu() for t in (q.probs, q.indices,
                                                                                          q.values)))
        on_host = dict(batch, draft_token_ids=batch["draft_token_ids"].cpu(), draft_probs=q_host)
        assert rejection_sample(**on_host, defer_check=True).token_lists() == on_device
        assert _eager_lists(rejection_sample(**on_host, backend="torch")) == on_device


def test_calls_queued_back_to_back_each_read_their_own_host_inputs():
    """Calls with host inputs (draft ids and q) queued one behind the other, none read yet, batches small and
    large (q of 128 x 8 drafts), each give what the same batch gives alone: no call's inputs reach another's
    kernel."""
    shapes = ((1, 2, "none"), (7, 3, "sparse"), (128, 8, "sparse"), (3, 1, "dense"), (64, 4, "none"))
    batches = [make_batch(B, 8193, k, mode, seed=s, filter_frac=0.3, K=16, device="cuda")
               for s, (B, k, mode) in enumerate(shapes)]
    alone = [rejection_sample(**b, defer_check=True).token_lists() for b in batches]

    def on_host(batch: dict) -> dict:
        q = batch["draft_probs"]
        if q is not None:
            q = DraftProbs(*(t if t is None else t.cpu() for t in (q.probs, q.indices, q.values)))
        return dict(batch, draft_token_ids=batch["draft_token_ids"].cpu(), draft_probs=q)

    torch.cuda.synchronize()
    queued = [rejection_sample(**on_host(b), defer_check=True) for b in batches]
    assert [out.token_lists() for out in queued] == alone


def test_deferred_check_raises_at_token_lists_cuda():
    batch = make_batch(3, 8193, 2, "dense", seed=2, device="cuda")
    batch["target_logits"][1, 4097] = float("nan")
    out = rejection_sample(**batch, defer_check=True)
    with pytest.raises(SamplerInputError, match="requests"):
        out.token_lists()


def test_warm_up_compiles_every_variant_a_server_meets():
    """After warm_up (what the verifier runs before it serves), the steps a server makes, decode and verify
    at every k up to the maximum, greedy, seeded and sampled with q of any width up to 16, filtered or not,
    at batch sizes that move every host part's offset, compile no further kernel (each would stall a
    request for the length of a Triton compile)."""
    from specwire.kernels.rejection_sampler import warm_up
    from specwire.kernels.rejection_sampler_triton import _rejection_kernel

    V, max_k, device = 8193, 4, torch.device("cuda")
    assert warm_up(device, V, max_k) == 2 + 3 * 2

    def compiled() -> int:
        return sum(len(cache[0]) for cache in _rejection_kernel.device_caches.values())

    before, g = compiled(), torch.Generator().manual_seed(0)
    assert before > 0
    for B in (1, 3, 16, 33):
        for k in range(max_k + 1):
            for width in (None, 1, 3, 16) if k else (None,):
                for temperature, top_k in ((0.0, 0), (1.0, 0), (0.7, 5)):
                    if width is not None and temperature == 0.0:
                        continue  # greedy requests draft one-hot
                    D = B * k
                    probs = None
                    if width is not None:
                        idx = torch.stack([torch.randperm(V, generator=g)[:width] for _ in range(D)])
                        probs = DraftProbs.sparse(idx, torch.full((D, width), 1.0 / width))
                        drafts = idx[:, 0]
                    else:
                        drafts = torch.randint(0, V, (D,), generator=g)
                    out = rejection_sample(
                        torch.randn(B * (k + 1), V, device=device), drafts,
                        torch.full((B,), k, dtype=torch.int32), probs, torch.full((B,), temperature),
                        torch.full((B,), top_k), torch.ones(B), torch.arange(B), torch.arange(B) * 7)
                    assert all(1 <= len(t) <= k + 1 for t in out.token_lists())
    assert compiled() == before
