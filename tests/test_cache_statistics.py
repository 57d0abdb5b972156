"""Sampled output through the speculation cache follows the target's distribution, hits and misses both.

The verifier's Scheduler with a co-located drafter (the in-process link, the same tables as over gRPC) serves
many unseeded T = 1 requests of one prompt. A small-vocabulary target whose next token depends on the last
one keeps the distribution concentrated, and a bigram head guesses the bonus token well enough that tables
both hit (the next round verifies the branch's sampled drafts against the top-K q they were drawn from,
which overlaps p, so many drafts are accepted and many rejected) and miss. Tokens three to six come
from rounds after a table lookup; their conditional distributions are checked against the target's own
softmax by a chi-square test (tail about 1e-6). The test has teeth: with the drafter shipping q^3
(renormalised) instead of the q its drafts were drawn from, the statistics were 1736 and 2686 against
critical values of 42 and 30 (measured 2026-11-23 with a patched drafter).

The same check runs with serial drafting queued on the device behind each sampler, where a round of the same
rows takes the drafter's proposal whole, q included, as the drafter left it (300 of ~760 rounds here): with
that q cubed (renormalised) in those rounds only, position 3 failed (2026-11-26).
"""

import asyncio
import functools
from collections import Counter

import pytest
import torch
from specwire.drafter.proposer import EagleProposer
from specwire.drafter.server import DrafterService
from specwire.verifier.drafter_link import DrafterLink, LocalDrafterLink
from specwire.verifier.scheduler import Scheduler, SchedulerConfig
from test_rejection_sampler import _fits
from test_services_e2e import bigram_head, record_whole_batches

from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import DrafterMetrics, VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import load_tokenizer
from specwire.weights import checkpoint_shapes

VOCAB, H, K, BRANCHES, REQUESTS, WAVE = 48, 32, 3, 2, 2400, 16
PROMPT = [5, 17, 9, 30]


def small_target() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    # head_dim 16, the smallest the Triton attention takes on CUDA (attention is switched off below anyway)
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(),
    )
    g = torch.Generator().manual_seed(3)
    sd = {n: torch.randn(s, generator=g) * 0.5 for n, s in checkpoint_shapes(config).items()}
    sd["lm_head.weight"] *= 3  # a concentrated next-token distribution: a few tokens carry most of it
    # Attention and MLP add nothing and the final norm only rescales: the next token depends on the last one
    # alone, so the bigram head's q overlaps p and the acceptance test decides many drafts either way.
    for i in range(config.num_layers):
        sd[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        sd[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    sd["model.norm.weight"].fill_(1.0)
    return config, sd


async def sample_many(engine: TargetEngine, link: LocalDrafterLink | DrafterLink, metrics: VerifierMetrics,
                      queued: bool) -> list[list[int]]:
    """queued: serial drafting, each round's drafts queued behind the last sampler, the requests sent in
    waves of WAVE (a round can take the queued drafts whole only when its rows are the last round's); else
    tables, every request at once."""
    scheduler = Scheduler(engine, load_tokenizer(default_model_path()), metrics,
                          SchedulerConfig(num_speculative_tokens=K, max_waiting=REQUESTS, draft_top_k=6,
                                          cache_branches=0 if queued else BRANCHES, table_wait=5.0,
                                          just_in_time_wait=5.0, queue_drafts=queued), link)
    scheduler.start()
    # Queued drafts are fed whole only to rows with room for them: longer requests, so that most have.
    params = SamplingParams(temperature=1.0, max_tokens=16 if queued else 6, ignore_eos=True)
    wave = WAVE if queued else REQUESTS
    outputs = []
    try:
        for first in range(0, REQUESTS, wave):
            requests = [scheduler.submit(PROMPT, params, str(i)) for i in range(first, first + wave)]
            for r in requests:
                while (await r.outputs.get()).finish_reason is None:
                    pass
            outputs += [r.tokens[len(PROMPT):] for r in requests]
        return outputs
    finally:
        await scheduler.close()


def target_probs(engine: TargetEngine, context: list[int]) -> torch.Tensor:
    slot = engine.allocate_slot()
    try:
        return torch.softmax(engine.prefill([(slot, context)]).logits[0].double(), -1).cpu()
    finally:
        engine.free_slot(slot)


def bigram_drafter_and_target(device: str) -> tuple[TargetEngine, EagleProposer, DrafterService]:
    """The small target on `device`, and a drafter service holding the bigram head beside it."""
    config, sd = small_target()
    engine = TargetEngine(checkpoint=(config, sd), device=device, dtype=torch.float32, max_slots=32,
                          max_context=64, max_verify_tokens=K + 1)
    head = bigram_head(config, sd, device, max_positions=64)
    proposer = EagleProposer(head, max_requests=32, max_context=64, max_drafts=K, max_top_k=8,
                             max_branches=BRANCHES)
    service = DrafterService(DrafterMetrics())
    service.load(proposer, config, load_tokenizer(default_model_path()).fingerprint, "eagle1:bigram")
    return engine, proposer, service


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("queued", "device"), [(False, "cpu"), (True, "cpu"),
                                                 pytest.param(True, "cuda", marks=ON_CUDA)],
                         ids=["tables", "queued_on_device", "queued_on_cuda"])
def test_sampled_tokens_after_table_lookups_follow_the_target(monkeypatch, queued, device):
    """Tables: hits and misses both. Queued on the device: many rounds feed the drafter's proposal whole,
    its top-K q where the drafter left it (QueuedDrafts.as_batch), the others split it per request; on CUDA
    under CUDA graphs and the Triton sampler."""
    calls = record_whole_batches(monkeypatch)
    engine, proposer, service = bigram_drafter_and_target(device)
    metrics = VerifierMetrics()
    owned: set[str] = set()
    link = LocalDrafterLink(functools.partial(service.run_step, 0, owned), service.info, service.mismatch,
                            metrics, proposer.device, step_timeout=5.0, inline=device == "cuda",
                            queue=functools.partial(service.queue_drafts, 0),
                            take=functools.partial(service.take_drafts, owned))
    outputs = asyncio.run(sample_many(engine, link, metrics, queued))

    if queued:
        assert metrics.queued_drafts._value.get() > 1000
        fed_whole = [sampled for _, sampled in calls]  # fed whole, q included
        assert sum(fed_whole) > 200 and not all(fed_whole), (sum(fed_whole), len(fed_whole))
    else:
        hits, misses = (metrics.cache[r]._value.get() for r in ("hit", "miss"))
        assert hits > 1000 and misses > 100, (hits, misses)
        assert metrics.just_in_time["drafted"]._value.get() > 100
    assert_follows_the_target(engine, metrics, outputs)


def assert_follows_the_target(engine: TargetEngine, metrics: VerifierMetrics, outputs: list[list[int]]
                              ) -> None:
    """Drafts were accepted and rejected, and each of tokens three to six, after its most common prefix,
    follows the target's softmax (chi-square)."""
    assert metrics.num_draft_tokens._value.get() > metrics.num_accepted_tokens._value.get() > 0
    for position in (2, 3, 4, 5):  # tokens from rounds that followed a lookup
        prefixes = Counter(tuple(o[:position]) for o in outputs)
        prefix, n = prefixes.most_common(1)[0]
        assert n > 300, prefixes.most_common(3)
        counts = torch.bincount(torch.tensor([o[position] for o in outputs if tuple(o[:position]) == prefix]),
                                minlength=VOCAB)
        assert _fits(counts, target_probs(engine, PROMPT + list(prefix))), (position, prefix)
