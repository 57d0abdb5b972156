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
"""

import asyncio
import functools
from collections import Counter

import torch
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig
from specwire.drafter.proposer import EagleProposer
from specwire.drafter.server import DrafterService
from specwire.verifier.drafter_link import LocalDrafterLink
from specwire.verifier.scheduler import Scheduler, SchedulerConfig
from test_rejection_sampler import _fits

from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import DrafterMetrics, VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import load_tokenizer
from specwire.weights import checkpoint_shapes

VOCAB, H, K, BRANCHES, REQUESTS = 48, 32, 3, 2, 2400
PROMPT = [5, 17, 9, 30]


def small_target() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
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


def bigram_head(config: ModelConfig, sd: dict[str, torch.Tensor]) -> EagleHead:
    """EAGLE-1 head whose output is embed(token): it drafts from lm_head(embed(token))."""
    layer = ModelConfig(**{**config.__dict__, "num_layers": 1})
    config = EagleHeadConfig(arch="eagle1", layer=layer, target_hidden_size=H, target_vocab_size=VOCAB)
    head = EagleHead(config, sd, torch.float32, "cpu", max_positions=64)
    head.init_weights(0)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


async def sample_many(engine: TargetEngine, link: LocalDrafterLink, metrics: VerifierMetrics
                      ) -> list[list[int]]:
    scheduler = Scheduler(engine, load_tokenizer(default_model_path()), metrics,
                          SchedulerConfig(num_speculative_tokens=K, max_waiting=REQUESTS, draft_top_k=6,
                                          cache_branches=BRANCHES, table_wait=5.0,
                                          just_in_time_wait=5.0), link)
    scheduler.start()
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    try:
        requests = [scheduler.submit(PROMPT, params, request_id=str(i)) for i in range(REQUESTS)]
        for r in requests:
            while (await r.outputs.get()).finish_reason is None:
                pass
        return [r.tokens[len(PROMPT):] for r in requests]
    finally:
        await scheduler.close()


def target_probs(engine: TargetEngine, context: list[int]) -> torch.Tensor:
    slot = engine.allocate_slot()
    try:
        return torch.softmax(engine.prefill([(slot, context)]).logits[0].double(), -1)
    finally:
        engine.free_slot(slot)


def test_sampled_tokens_after_table_lookups_follow_the_target():
    config, sd = small_target()
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=32,
                          max_context=64, max_verify_tokens=K + 1)
    proposer = EagleProposer(bigram_head(config, sd), max_requests=32, max_context=64, max_drafts=K,
                             max_top_k=8, max_branches=BRANCHES)
    service = DrafterService(DrafterMetrics())
    tokenizer = load_tokenizer(default_model_path())
    service.load(proposer, config, tokenizer.fingerprint, "eagle1:bigram")
    metrics = VerifierMetrics()
    link = LocalDrafterLink(functools.partial(service.run_step, 0, set()), service.info, service.mismatch,
                            metrics, proposer.device, step_timeout=5.0)
    outputs = asyncio.run(sample_many(engine, link, metrics))

    hits, misses = (metrics.cache[r]._value.get() for r in ("hit", "miss"))
    assert hits > 1000 and misses > 100, (hits, misses)
    assert metrics.just_in_time["drafted"]._value.get() > 100
    assert metrics.num_draft_tokens._value.get() > metrics.num_accepted_tokens._value.get() > 0
    for position in (2, 3, 4, 5):  # tokens from rounds that followed a lookup
        prefixes = Counter(tuple(o[:position]) for o in outputs)
        prefix, n = prefixes.most_common(1)[0]
        assert n > 300, prefixes.most_common(3)
        counts = torch.bincount(torch.tensor([o[position] for o in outputs if tuple(o[:position]) == prefix]),
                                minlength=VOCAB)
        assert _fits(counts, target_probs(engine, PROMPT + list(prefix))), (position, prefix)
