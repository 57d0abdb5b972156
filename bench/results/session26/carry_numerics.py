"""Greedy continuations of held-out prompts prefilled on their own vs carried by a verification (GPU): how
far the first logits and the cache differ, and whether the greedy tokens do.

    python3 carry_numerics.py synthetic:smollm2-135m                      # bf16, then float32 (17:58 UTC)
    python3 carry_numerics.py synthetic:smollm2-135m prefill-attention    # bf16 only, run so at 18:01 UTC
"""
import json
import sys

import torch

from specwire.engine import TargetEngine
from specwire.model_source import load_model

model = sys.argv[1]
dtypes = (torch.bfloat16, torch.float32)
if len(sys.argv) > 2 and sys.argv[2] == "prefill-attention":  # the prefill's tiles everywhere
    from specwire.kernels import attention_triton
    attention_triton._launch_config = lambda device, batch, kv, m_rows, head_dim, elem: (
        128, 64 if head_dim * elem > 128 else 128, 8, 2)
    print("attention: the prefill's launch config everywhere")
    dtypes = (torch.bfloat16,)
with open("bench/data/heldout_chat_sharegpt.jsonl") as f:
    prompts = [json.loads(line) for line in f][:24]
for dtype in dtypes:
    config, sd, tok, _ = load_model(model, torch.device("cuda"), dtype)
    engine = TargetEngine(device="cuda", dtype=dtype, max_slots=4, max_context=1024, checkpoint=(config, sd),
                          max_verify_tokens=5, carry_rows=64, carry_width=5)
    flips, worst, kv = 0, 0.0, 0.0
    for i, p in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]))[:300]
        # A: prefilled alone in slot 0. B: carried in slot 1 by a verification of slot 2 (decoding something).
        a = engine.prefill([(0, ids)]).logits[0]
        engine.prefill([(2, [5, 6, 7])])
        b = engine.verify([2], [[8, 9, 10, 11, 12]], [3], prompts=[(1, ids)]).logits[-1]
        worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
        n = len(ids)
        kv = max(kv, ((engine.cache.k[:, 0, :, :n] - engine.cache.k[:, 1, :, :n]).abs().max()
                      / engine.cache.k[:, 0, :, :n].abs().max()).item())
        outs = []
        for slot, first in ((0, a), (1, b)):
            toks = [int(first.argmax())]
            for _ in range(48):
                toks.append(int(engine.decode([slot], [toks[-1]], [n + len(toks) - 1]).logits[0].argmax()))
            outs.append(toks)
        if outs[0] != outs[1]:
            flips += 1
            j = next(j for j, (x, y) in enumerate(zip(*outs, strict=True)) if x != y)
            print(f"{dtype} prompt {i} ({n} tokens): differ at {j}")
    print(f"{dtype}: {flips} of {len(prompts)} continuations differ; first logits max rel diff {worst:.2e}; "
          f"cache k max rel diff {kv:.2e}")
