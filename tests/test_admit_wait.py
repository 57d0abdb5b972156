"""--admit-wait-ms: while requests decode, a new request waits up to that long for more arrivals to share
its prefill step; it never waits once the waiting fill the free slots, nor past the wait (no starvation), and
with 0 (the default) every arrival is prefilled at once. Target-only rounds on the engine thread, which must
stop for a wait that ran out."""

import asyncio
import time

import pytest
import torch
from specwire.verifier.scheduler import Request, Scheduler, SchedulerConfig
from test_services_e2e import MAX_CONTEXT, tiny_target

from specwire.colocated import colocated_link
from specwire.config import default_aux_layers
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.synthetic import RANDOM_HEAD
from specwire.tokenizer import load_tokenizer

LONG = SamplingParams(temperature=0.0, max_tokens=MAX_CONTEXT - 20, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TOKENIZER = load_tokenizer(default_model_path())


async def finish(r: Request) -> None:
    while (await r.outputs.get()).finish_reason is None:
        pass


async def serve(admit_wait: float, arrivals: list[float], speculative: bool = False
                ) -> tuple[list[Request], float]:
    """One long request decoding, then short ones submitted `arrivals` seconds after its first token; three
    slots; target-only, or with a co-located drafter. Returns the requests and the prefill steps taken."""
    config, sd = tiny_target()
    aux = default_aux_layers(config.num_layers) if speculative else ()  # what the random EAGLE-3 head reads
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=3,
                          max_context=MAX_CONTEXT, aux_layers=aux, max_verify_tokens=4)
    metrics = VerifierMetrics()
    # A random EAGLE-3 head in this process; its drafts are forced accepted below (rounds of several tokens).
    link = colocated_link(engine, TOKENIZER, metrics, head=RANDOM_HEAD, device="cpu", k=3, max_branches=0,
                          cuda_graphs=False, step_timeout=5.0) if speculative else None
    speculation = {"num_speculative_tokens": 3, "cache_branches": 0, "forced_acceptance": (0.9, 0.8, 0.7)} \
        if speculative else {"num_speculative_tokens": 0}
    scheduler = Scheduler(engine, TOKENIZER, metrics,
                          SchedulerConfig(admit_wait=admit_wait, **speculation), link)
    scheduler.start()
    try:
        first = scheduler.submit([5, 6, 7, 8], LONG, "long")
        await first.outputs.get()  # decoding now
        requests, started = [first], time.perf_counter()
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            requests.append(scheduler.submit([9 + i, 10, 11], SHORT, f"short{i}"))
        await asyncio.gather(*(finish(r) for r in requests[1:]))
        await finish(first)
        return requests, metrics.registry.get_sample_value("specwire_prefill_step_seconds_count")
    finally:
        await scheduler.close()


@pytest.mark.parametrize("speculative", [False, True], ids=["target_only", "speculative"])
def test_arrivals_share_a_prefill_once_they_fill_the_free_slots(speculative):
    requests, steps = asyncio.run(serve(admit_wait=30.0, arrivals=[0.0, 0.05], speculative=speculative))
    assert steps == 2  # the long request's, then both short ones in one
    long, a, b = requests
    assert a.first_token_at > b.arrived  # a waited for b (the one prefill step above holds both)
    assert long.drafts > 0 if speculative else long.drafts == 0  # rounds with drafts when speculating
    assert all(len(r.tokens) - len(r.prompt) == SHORT.max_tokens for r in (a, b))


def test_every_arrival_is_prefilled_at_once_by_default():
    requests, steps = asyncio.run(serve(admit_wait=0.0, arrivals=[0.0, 0.3]))
    assert steps == 3
    long, a, b = requests
    assert a.first_token_at < b.arrived  # a did not wait for b


@pytest.mark.parametrize("speculative", [False, True], ids=["target_only", "speculative"])
def test_a_lone_arrival_waits_no_longer_than_the_wait(speculative):
    (long, a), steps = asyncio.run(serve(admit_wait=0.05, arrivals=[0.0], speculative=speculative))
    assert steps == 2 and len(a.tokens) - len(a.prompt) == SHORT.max_tokens
    # Prefilled once the wait ran out, or when the long request ended if that came first (nothing decoding).
    assert a.first_token_at >= min(a.arrived + 0.05, long.last_token_at)
    assert long.last_token_at > a.first_token_at  # here the wait ran out while the long request decoded
