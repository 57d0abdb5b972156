"""Which attention launch configs for decode/verify rows give a carried prompt the bits of its prefill, and
what they cost: per variant of the config for <= 64 query rows (the prefill's kept), (1) the SmolLM2-shape
carried-vs-prefilled check in bf16 (24 held-out prompts, 32 greedy tokens each); (2) the graph-replayed
verify step of the 8B shape (bf16, batch 1 and 16, context 600) timed with CUDA events. Run against the
tree of 42bd104, whose _launch_config took (device, batch, kv heads, m rows, head_dim, element bytes);
m64w4 is the config 27c93ca ships.

    python3 attn_invariance.py now,m16w4,m64w4,m128w8 time
"""
import json
import sys

import torch
from specwire.kernels import attention_triton

from specwire.engine import TargetEngine
from specwire.model_source import load_model

original = attention_triton._launch_config


def variant(block_m: int | None, warps: int, stages: int):
    def config(device, batch, kv, m_rows, head_dim, elem):
        if m_rows > 64 or block_m is None:
            return original(device, batch, kv, m_rows, head_dim, elem)
        return block_m, 64 if head_dim * elem > 128 else 128, warps, stages  # the prefill's BLOCK_N
    return config


VARIANTS = {"now": (None, 0, 0), "m16w4": (16, 4, 2), "m64w4": (64, 4, 2), "m128w8": (128, 8, 2)}
with open("bench/data/heldout_chat_sharegpt.jsonl") as f:
    prompts = [json.loads(line)["prompt"] for line in f][:24]
for name in sys.argv[1].split(","):
    attention_triton._launch_config = variant(*VARIANTS[name])
    config, sd, tok, _ = load_model("synthetic:smollm2-135m", torch.device("cuda"), torch.bfloat16)
    engine = TargetEngine(device="cuda", dtype=torch.bfloat16, max_slots=4, max_context=1024,
                          checkpoint=(config, sd), max_verify_tokens=5, carry_rows=64, carry_width=5)
    worst, flips = 0.0, 0
    for text in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))[:300]
        a = engine.prefill([(0, ids)]).logits[0]
        engine.prefill([(2, [5, 6, 7])])
        b = engine.verify([2], [[8, 9, 10, 11, 12]], [3], prompts=[(1, ids)]).logits[-1]
        n = len(ids)
        worst = max(worst, (engine.cache.k[:, 0, :, :n] - engine.cache.k[:, 1, :, :n]).abs().max().item())
        ta, tb = int(a.argmax()), int(b.argmax())
        for j in range(32):
            la = engine.decode([0], [ta], [n + j]).logits[0]
            lb = engine.decode([1], [tb], [n + j]).logits[0]
            if ta != tb:
                break
            ta, tb = int(la.argmax()), int(lb.argmax())
        flips += ta != tb
    del engine, sd
    timings = {}
    if len(sys.argv) > 2:
        config, sd, _, _ = load_model("synthetic:llama-3.1-8b", torch.device("cuda"), torch.bfloat16)
        engine = TargetEngine(device="cuda", dtype=torch.bfloat16, max_slots=16, max_context=1024,
                              checkpoint=(config, sd), max_verify_tokens=5)
        for b in (1, 16):
            slots = list(range(b))
            engine.prefill([(s, [7] * 600) for s in slots])
            rows = [[1, 2, 3, 4, 5]] * b
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                engine.verify(slots, rows, [600] * b)
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                engine.verify(slots, rows, [600] * b)
            end.record()
            torch.cuda.synchronize()
            timings[b] = start.elapsed_time(end) / 50
        del engine, sd
    torch.cuda.empty_cache()
    print(f"{name}: carried-vs-prefilled cache k max abs diff {worst:.3e}, continuations differing "
          f"{flips}/24; 8B verify step ms {timings}", flush=True)
