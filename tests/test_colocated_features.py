"""The co-located drafter is handed target features as tensors (views of verifier.feature_store) instead of
bytes in its steps. Whatever the drafts, the output stays the target's, so only this test would see a wrong
row: for every token of every request, the drafter must be handed the target's own feature (the three taps
of an EAGLE-3 head), as a prefill of the request's final tokens computes them. More requests than slots, so
slots are reused; serial drafting (through DraftSteps, or queued on the device behind the sampler, where the
features are gathered from the store by the device) and speculation-cache tables; on a GPU machine also with
the drafter on another GPU than the target (the store's rows then cross devices). The random head's drafts
are forced accepted at high rates (as the synthetic benchmarks do), so that rounds settle several tokens.
Prompts admitted while others decode are carried by a verification (--carry-rows), or prefilled on their
own; the features travel as tensors, or (`bytes`) in the steps as over gRPC (the verifier then reads them
back from its own table)."""

import asyncio
import functools
from collections import defaultdict

import pytest
import torch
from specwire.drafter.eagle_head import random_eagle_head
from specwire.drafter.proposer import EagleProposer
from specwire.drafter.server import DrafterService
from specwire.verifier.drafter_link import DrafterLink, LocalDrafterLink
from specwire.verifier.scheduler import Scheduler, SchedulerConfig
from test_services_e2e import MAX_CONTEXT, tiny_target

from specwire.engine import TargetEngine
from specwire.metrics import DrafterMetrics, VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.synthetic import synthetic_tokenizer

K, SLOTS, REQUESTS, MAX_TOKENS = 3, 3, 7, 30


async def generate(engine: TargetEngine, link: LocalDrafterLink | DrafterLink, cache_branches: int,
                   queue_drafts: bool, max_tokens: int = MAX_TOKENS, drafting_epoch: int = 0,
                   metrics: VerifierMetrics | None = None, drafting_modes: tuple[str, ...] | None = None,
                   forced_acceptance: tuple[float, ...] = (0.9, 0.8, 0.7), **config
                   ) -> tuple[list[list[int]], float]:
    """Each request's tokens, and how many prompts a verification carried (the scheduler's metrics:
    `metrics`, or its own); `config`: more SchedulerConfig fields."""
    # The synthetic tokenizer of the target's vocabulary: outputs are only compared as ids, and GPU runs need
    # no model staged for it.
    metrics = metrics or VerifierMetrics()
    scheduler = Scheduler(engine, synthetic_tokenizer(engine.config), metrics,
                          SchedulerConfig(num_speculative_tokens=K, cache_branches=cache_branches,
                                          table_wait=5.0, just_in_time_wait=5.0,
                                          forced_acceptance=forced_acceptance, queue_drafts=queue_drafts,
                                          drafting_epoch=drafting_epoch, drafting_modes=drafting_modes,
                                          **config),
                          link)
    scheduler.start()
    # A gRPC link connects in the background: a request that finished before it did never reached the
    # drafter (in CI, a 0.2 s connect outlasted the first requests), and the checks here need every one.
    for _ in range(1000):
        if link.connected:
            break
        await asyncio.sleep(0.01)
    assert link.connected, f"the drafter link did not connect in 10 s: {getattr(link, 'last_error', '')}"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 30_000, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (REQUESTS,), generator=g)]
    try:
        # Seeded: the forced acceptance draws follow each request's seed (an unseeded request draws its own),
        # so the rounds, and whether a slot frees while others decode (a prompt to carry), are the same every
        # run. Unseeded, 1 or 4 of the 7 prompts were carried from run to run, and once in CI none.
        requests = [scheduler.submit(p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True, seed=i), request_id=str(i))
                    for i, p in enumerate(prompts)]
        for r in requests:
            while (await r.outputs.get()).finish_reason is None:
                pass
        carried = metrics.registry.get_sample_value("specwire_prompts_carried_total")
        return [r.tokens for r in requests], carried
    finally:
        await scheduler.close()


def two_gpus():
    if not torch.cuda.is_available():
        return pytest.param(None, marks=pytest.mark.skip(reason="needs CUDA"))
    return pytest.param(("cuda:0", f"cuda:{torch.cuda.device_count() - 1}"), marks=pytest.mark.gpu)


@pytest.mark.parametrize("devices", [("cpu", "cpu"), two_gpus()], ids=["cpu", "gpus"])
@pytest.mark.parametrize("cache_branches, queue_drafts, carry_rows, as_bytes", [
    (0, False, 0, False), (0, True, 0, False), (4, False, 0, False),
    (0, False, 16, False), (0, True, 16, False), (4, False, 16, False),
    (0, False, 16, True), (4, False, 16, True),
], ids=["serial", "queued", "tables", "serial_carried", "queued_carried", "tables_carried",
        "serial_carried_bytes", "tables_carried_bytes"])
def test_the_colocated_drafter_is_handed_the_target_features_of_every_token(cache_branches, queue_drafts,
                                                                          carry_rows, as_bytes, devices):
    drafter_device, verifier_device = devices
    config, sd, head, engine, proposer, handed = recording_drafter(drafter_device, verifier_device,
                                                                   cache_branches, carry_rows)
    queued = recording_queued(proposer, handed)
    service = drafter_service(proposer, config)
    owned = set()
    on_device = not as_bytes  # bytes: no feature device, so steps carry the features as over gRPC
    link = LocalDrafterLink(functools.partial(service.run_step, 0, owned), service.info, service.mismatch,
                            VerifierMetrics(), proposer.device if on_device else None, step_timeout=5.0,
                            queue=functools.partial(service.queue_drafts, 0) if on_device else None,
                            take=functools.partial(service.take_drafts, owned) if on_device else None)
    outputs, carried = asyncio.run(generate(engine, link, cache_branches, queue_drafts))
    assert bool(queued) == queue_drafts
    assert (carried > 0) == (carry_rows > 0)
    assert_handed_the_target_features(handed, outputs, config, sd, head, verifier_device)


def recording_drafter(drafter_device: str, verifier_device: str, cache_branches: int, carry_rows: int):
    """The tiny target's engine and a random EAGLE-3 head's proposer that records the features each add and
    update hands it (handed: drafter key -> tensors, in order)."""
    config, sd = tiny_target()
    head = random_eagle_head(config, sd, torch.float32, drafter_device, MAX_CONTEXT)
    assert head.config.feature_dim == 3 * config.hidden_size
    engine = TargetEngine(checkpoint=(config, sd), device=verifier_device, dtype=torch.float32,
                          max_slots=SLOTS, max_context=MAX_CONTEXT, aux_layers=head.config.aux_layers,
                          max_verify_tokens=K + 1, carry_rows=carry_rows, carry_width=K + 1)
    proposer = EagleProposer(head, max_requests=SLOTS, max_context=MAX_CONTEXT, max_drafts=K, max_top_k=8,
                             max_branches=cache_branches)
    handed = defaultdict(list)
    append = proposer._append

    def record(request_id, request, tokens, features):
        handed[request_id].append(features.to("cpu", copy=True))
        append(request_id, request, tokens, features)

    proposer._append = record
    return config, sd, head, engine, proposer, handed


def recording_queued(proposer, handed) -> set:
    """Records in `handed` the features the proposer's queued drafting gathers (as many rows as settled);
    returns the set of drafter keys it queued for, filled as it runs."""
    queue, queued = proposer.queue_after_verification, set()

    def record_queued(request_ids, *args):
        queue(request_ids, *args)
        pending = proposer._meta[proposer._PENDING].tolist()
        for b, rid in enumerate(request_ids):
            handed[rid].append(proposer._features[b, :pending[b]].to("cpu", copy=True))
        queued.update(request_ids)

    proposer.queue_after_verification = record_queued
    return queued


def drafter_service(proposer: EagleProposer, config) -> DrafterService:
    service = DrafterService(DrafterMetrics())
    service.load(proposer, config, synthetic_tokenizer(config).fingerprint, "eagle3:random")
    return service


def assert_handed_the_target_features(handed, outputs, config, sd, head, verifier_device: str,
                                      stream: int = 0, only: set[int] | None = None,
                                      max_tokens: int = MAX_TOKENS) -> None:
    """Every request's (or those in `only`) handed features on drafter stream `stream` are the target's own,
    as a prefill of its final tokens computes them."""
    reference = TargetEngine(checkpoint=(config, sd), device=verifier_device, dtype=torch.float32,
                             max_slots=1, max_context=MAX_CONTEXT, aux_layers=head.config.aux_layers)
    for i, tokens in enumerate(outputs):
        if only is not None and i not in only:
            continue
        got = torch.cat(handed[f"{stream}/{i}"])
        # rows 0..n-1: the positions of the tokens the drafter was told of, but the last
        assert len(tokens) - max_tokens < got.shape[0] < len(tokens)
        want = reference.prefill([(0, tokens)]).aux_hidden[:got.shape[0]].cpu()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"request {i}")
