"""SmolLM2 + the shipped head on this CPU, co-located, batch 1 (N requests one after another), the adaptive
drafting mode (serial and none by default where drafts queue; argv[2] names modes), drafts queued; the debug
log shows each epoch's rate. From the repo root:
    python bench/results/session35/drafting_epochs_cpu/run.py 8
(Formatted for ruff after the run that wrote output.txt; the same statements.)"""

import asyncio
import logging
import sys
import time

import torch
from specwire.drafter.self_distill import read_prompts
from specwire.verifier.scheduler import Scheduler, SchedulerConfig

from specwire.colocated import colocated_link
from specwire.commands.bench import build_engine
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams

logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f %(message)s")
logging.getLogger("specwire.verifier").setLevel(logging.DEBUG)

N, MODES = int(sys.argv[1]), tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
torch.set_num_threads(1)
prompts = read_prompts("bench/data/heldout_chat_sharegpt.jsonl")[:N]
engine, tok = build_engine(None, None, "cpu", 1, 4, False)


async def main() -> None:
    metrics = VerifierMetrics()
    link = colocated_link(engine, tok, metrics, head=None, device=None, k=4, max_branches=8,
                          cuda_graphs=False, min_confidence=0.0, step_timeout=60.0)
    config = SchedulerConfig(num_speculative_tokens=4, cache_branches=8, drafting_epoch=16, queue_drafts=True,
                             drafting_modes=MODES, max_waiting=N)
    s = Scheduler(engine, tok, metrics, config, link)
    s.start()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        r = s.submit(ids, SamplingParams(temperature=0.0, max_tokens=128), request_id=str(i))
        while (await r.outputs.get()).finish_reason is None:
            pass
        print(f"{1e3 * (time.perf_counter() - t):8.0f} request {i} done, {r.num_output} tokens", flush=True)
    for m in ("tables", "serial", "none"):
        v = metrics.registry.get_sample_value("specwire_spec_cache_rounds_total", {"mode": m})
        sec = metrics.registry.get_sample_value("specwire_spec_cache_round_seconds_total", {"mode": m})
        tk = metrics.registry.get_sample_value("specwire_spec_cache_round_tokens_total", {"mode": m})
        print(m, v, sec and round(1e3 * sec / max(v, 1), 2), tk and round(tk / max(v, 1), 2))
    await s.close()


asyncio.run(main())
