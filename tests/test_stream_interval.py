"""--stream-interval N: a stream's chunks gather N tokens before they go out, except a request's first token
(TTFT unchanged) and its last ones; the tokens and text a client reads are those of N = 1, none lost."""

import asyncio

import pytest
import torch
from specwire.verifier.scheduler import Output, Scheduler, SchedulerConfig
from test_services_e2e import MAX_CONTEXT, tiny_target

from specwire.default_model import default_model_path
from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.tokenizer import load_tokenizer

MAX_TOKENS = 23


async def streams(interval: int) -> list[list[Output]]:
    config, sd = tiny_target()
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=2,
                          max_context=MAX_CONTEXT)
    scheduler = Scheduler(engine, load_tokenizer(default_model_path()), VerifierMetrics(),
                          SchedulerConfig(num_speculative_tokens=0, stream_interval=interval))
    scheduler.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [scheduler.submit(list(range(5 + i, 12 + 2 * i)), params, str(i)) for i in range(3)]
        got = []
        for r in requests:
            chunks = [await r.outputs.get()]
            while chunks[-1].finish_reason is None:
                chunks.append(await r.outputs.get())
            got.append(chunks)
        return got
    finally:
        await scheduler.close()


@pytest.mark.parametrize("interval", [4, 7])
def test_chunks_gather_the_interval_and_lose_nothing(interval):
    every, gathered = asyncio.run(streams(1)), asyncio.run(streams(interval))
    for one, chunks in zip(every, gathered, strict=True):
        assert all(len(c.token_ids) == 1 for c in one) and len(one) == MAX_TOKENS
        assert len(chunks[0].token_ids) == 1  # the first token is not held back
        assert all(len(c.token_ids) == interval for c in chunks[1:-1])
        assert 1 <= len(chunks[-1].token_ids) <= interval and chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == [t for c in one for t in c.token_ids]
        assert "".join(c.text for c in chunks) == "".join(c.text for c in one)
