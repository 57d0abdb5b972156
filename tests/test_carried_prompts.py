"""Prompts carried by a verification (engine carry_rows, the verifier's --carry-rows): a new request's prompt
rides the running batch's next verification forward, in rows of carry_width tokens, instead of a prefill
step of its own. The forward must be exactly the prefill plus the verification (same logits, features and
cache), and through the scheduler the carried requests' output must be what a prefill step gives."""

import asyncio

import pytest
import torch
from specwire.verifier.scheduler import Scheduler, SchedulerConfig
from test_engine import close, tiny_checkpoint
from test_prefill_rows import random_prompts
from test_services_e2e import MAX_CONTEXT, tiny_target

from specwire.colocated import colocated_link
from specwire.config import default_aux_layers
from specwire.engine import TargetEngine, carrying_capture_sizes
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.synthetic import RANDOM_HEAD, synthetic_tokenizer


def test_carrying_capture_sizes():
    assert carrying_capture_sizes(16, 64) == [1, 2, 4, 8, 16, 32, 48, 64, 80]
    assert carrying_capture_sizes(64, 64) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert carrying_capture_sizes(4, 10) == [1, 2, 4, 14]


def engines(device: str, **kwargs) -> tuple[TargetEngine, TargetEngine]:
    """Two engines on the same weights: one carries prompts, the other prefills them on their own."""
    made = [TargetEngine(device=device, dtype=torch.float32, max_slots=5, max_context=256, aux_layers=(1,),
                         checkpoint=tiny_checkpoint(), max_verify_tokens=4, carry_rows=carry, carry_width=5,
                         **kwargs) for carry in (32, 0)]
    return made[0], made[1]


def check_carried_forward(device: str, cuda_graphs: bool) -> None:
    carrier, reference = engines(device, cuda_graphs=cuda_graphs)
    decoding = list(zip([3, 0], random_prompts([9, 70], seed=5), strict=True))
    carried = list(zip([4, 1, 2], random_prompts([1, 12, 37], seed=6), strict=True))
    for engine in (carrier, reference):
        engine.prefill(decoding)
    # Rows of 4 and 1 tokens at each decoding prompt's end (the last token, then drafts), as a round feeds.
    rows, slots, starts = [[7, 8, 9, 10], [11]], [3, 0], [9, 70]

    out = carrier.verify(slots, rows, starts, prompts=carried)
    alone = reference.prefill(carried)
    verified = reference.verify(slots, rows, starts)
    fed = sum(map(len, rows))
    assert out.logits.shape[0] == fed + len(carried)
    assert close(out.logits[:fed], verified.logits, 1e-5)
    assert close(out.logits[fed:], alone.logits, 1e-5)  # each carried prompt's last token
    assert close(out.hidden[:fed], verified.hidden, 1e-5)
    assert close(out.hidden[fed:], alone.hidden, 1e-5)  # every carried prompt token, in order
    assert close(out.aux_hidden, torch.cat([verified.aux_hidden, alone.aux_hidden]), 1e-5)
    for slot, length in [(3, 9 + 4), (0, 70 + 1), (4, 1), (1, 12), (2, 37)]:
        for cache in ("k", "v"):
            got, want = (getattr(e.cache, cache)[:, slot, :, :length] for e in (carrier, reference))
            assert close(got, want, 1e-5), (slot, cache)


def test_a_carried_prompt_is_its_prefill_and_the_verification_unchanged():
    """Eager, on the CPU: the verification's logits and features as without the prompts; each prompt's last
    logits, every token's features and its keys and values as its own prefill's."""
    check_carried_forward("cpu", cuda_graphs=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_carried_prompt_is_its_prefill_in_cuda_graphs():
    check_carried_forward("cuda", cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_carried_prompt_is_its_prefill_bit_for_bit_in_bf16():
    """What keeps greedy output independent of when a request arrived: in bf16 a prompt carried in rows of 5
    gets exactly the keys, values and last logits its prefill (rows of 64) gets. Attention tiles that depend
    on the rows a launch holds broke this by about one bf16 step (bench/results/session26/)."""
    carrier, reference = (TargetEngine(device="cuda", dtype=torch.bfloat16, max_slots=5, max_context=256,
                                       checkpoint=tiny_checkpoint(), max_verify_tokens=4, carry_rows=carry,
                                       carry_width=5) for carry in (32, 0))
    prompts = list(zip([4, 1, 2], random_prompts([1, 12, 137], seed=6), strict=True))
    for engine in (carrier, reference):
        engine.prefill([(3, [5, 6, 7])])
    out = carrier.verify([3], [[8, 9, 10, 11]], [3], prompts=prompts)
    alone = reference.prefill(prompts)
    assert torch.equal(out.logits[4:], alone.logits)
    for slot, prompt in prompts:
        for cache in ("k", "v"):
            got, want = (getattr(e.cache, cache)[:, slot, :, :len(prompt)] for e in (carrier, reference))
            assert torch.equal(got, want), (slot, cache)


def test_an_engine_without_carry_rows_refuses_prompts():
    engine = TargetEngine(device="cpu", dtype=torch.float32, max_slots=2, max_context=64,
                          checkpoint=tiny_checkpoint(), cuda_graphs=False)
    with pytest.raises(ValueError, match="carry_rows=0"):
        engine.verify([0], [[1]], [0], prompts=[(1, [2, 3])])
    with pytest.raises(ValueError, match="carry_rows"):
        TargetEngine(device="cpu", max_slots=2, max_context=64, checkpoint=tiny_checkpoint(), carry_rows=8,
                     carry_width=1)


# ------------------------------------------------------------------------------------------- scheduler

SLOTS, REQUESTS, MAX_TOKENS = 3, 9, 12


async def serve(carry_rows: int, speculative: bool, temperature: float
                ) -> tuple[list[list[int]], list[int], dict]:
    """More requests than slots, so most are admitted while others decode; target-only or with a co-located
    random EAGLE-3 head (its drafts rejected or accepted by the target, never forced)."""
    config, sd = tiny_target()
    aux = default_aux_layers(config.num_layers) if speculative else ()
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=SLOTS,
                          max_context=MAX_CONTEXT, aux_layers=aux, max_verify_tokens=4, carry_rows=carry_rows)
    metrics, tokenizer = VerifierMetrics(), synthetic_tokenizer(config)
    link = colocated_link(engine, tokenizer, metrics, head=RANDOM_HEAD, device="cpu", k=3, max_branches=0,
                          cuda_graphs=False, step_timeout=5.0) if speculative else None
    scheduler = Scheduler(engine, tokenizer, metrics, SchedulerConfig(
        num_speculative_tokens=3 if speculative else 0, cache_branches=0), link)
    scheduler.start()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 30, (REQUESTS,), generator=g)]
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS + i, ignore_eos=True, seed=i)
                  for i in range(REQUESTS)]
        requests = [scheduler.submit(p, sp, request_id=str(i))
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        for r in requests:
            while (await r.outputs.get()).finish_reason is None:
                pass
        counts = {name: metrics.registry.get_sample_value(f"specwire_{name}") or 0.0
                  for name in ("prompts_carried_total", "prefill_step_seconds_count", "prompt_tokens_total")}
        return [r.tokens[len(r.prompt):] for r in requests], [r.drafts for r in requests], counts
    finally:
        await scheduler.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded_T1"])
@pytest.mark.parametrize("speculative", [False, True], ids=["target_only", "speculative"])
def test_carried_prompts_give_the_output_of_prefill_steps(speculative, temperature):
    """Greedy and seeded T = 1 requests: each a function of its prompt and seed only, so the carrying run
    and the prefilling run must agree token for token; only the carrying run carries."""
    carrying, drafted, carried = asyncio.run(serve(32, speculative, temperature))
    prefilling, _, prefilled = asyncio.run(serve(0, speculative, temperature))
    assert carrying == prefilling
    assert [len(t) for t in carrying] == [MAX_TOKENS + i for i in range(REQUESTS)]
    # The first SLOTS requests are prefilled (nothing decodes yet); most of the rest are carried.
    assert carried["prompts_carried_total"] >= REQUESTS - SLOTS - 2
    assert carried["prefill_step_seconds_count"] < prefilled["prefill_step_seconds_count"]
    assert prefilled["prompts_carried_total"] == 0
    assert carried["prompt_tokens_total"] == prefilled["prompt_tokens_total"]
    # The drafter was told of carried requests as of prefilled ones: every request verified drafts.
    assert all(drafted) if speculative else not any(drafted)


async def arrivals(bursts: list[list[int]]) -> dict:
    """One long request decoding (target-only, 4 slots, 8 carry rows of 5: 11 rows of room beside it),
    then each burst's prompts (their lengths) submitted together once the last burst has finished."""
    config, sd = tiny_target()
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=4,
                          max_context=MAX_CONTEXT, carry_rows=8, carry_width=5)
    metrics = VerifierMetrics()
    scheduler = Scheduler(engine, synthetic_tokenizer(config), metrics,
                          SchedulerConfig(num_speculative_tokens=0))
    scheduler.start()
    try:
        params = SamplingParams(max_tokens=MAX_CONTEXT - 10, ignore_eos=True)
        long = scheduler.submit([5, 6, 7], params, "long")
        await long.outputs.get()  # decoding now
        for i, burst in enumerate(bursts):
            requests = [scheduler.submit([9] * n, SamplingParams(max_tokens=4, ignore_eos=True), f"{i}.{j}")
                        for j, n in enumerate(burst)]
            for r in requests:
                while (await r.outputs.get()).finish_reason is None:
                    pass
        assert long.live  # every burst came while it decoded
        return {name: metrics.registry.get_sample_value(f"specwire_{name}")
                for name in ("prompts_carried_total", "prefill_step_seconds_count")}
    finally:
        await scheduler.close()


def test_a_burst_that_does_not_fit_is_prefilled_together():
    """Prompts of 20 tokens take 4 rows: one or two fit beside the long request and ride verifications;
    three (12 rows) share one prefill step rather than riding in turn."""
    assert asyncio.run(arrivals([[20], [20, 20]])) == {"prompts_carried_total": 3.0,
                                                        "prefill_step_seconds_count": 1.0}
    assert asyncio.run(arrivals([[20, 20, 20]])) == {"prompts_carried_total": 0.0,
                                                     "prefill_step_seconds_count": 2.0}
