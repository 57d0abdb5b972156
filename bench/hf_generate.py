"""transformers `generate()` as the outside baseline of bench_services.py, in its own process on the
target's GPU: bf16, greedy or sampled (top-k and top-p off, as the services' requests), a fixed length
(min_new_tokens = max_new_tokens), left-padded batches of the same chat prompts encoded by specwire's
tokenizer, and a static KV cache where transformers accepts one (else its default dynamic cache; the JSON says
which ran).

    python bench/hf_generate.py --model /root/m/smol.gguf --device cuda:1 --prompts-json P.json \
        --batch-sizes 1,8 --temperatures 0 --max-tokens 32

A GGUF file loads through transformers' own GGUF reader; `synthetic:NAME` builds LlamaForCausalLM of that
shape with transformers' random initialisation on the device (other random numbers than the services' model,
the same shapes and cost). Prints one JSON object: per (batch, temperature), tokens/s of the whole generate()
call, TTFT (a 1-token generate() of the same batch) and TPOT ((full - TTFT) / (tokens - 1)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specwire.engine import device_and_dtype
from specwire.model_source import load_model_tokenizer
from specwire.synthetic import synthetic_config, synthetic_shape


def load_hf_model(model: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (shape := synthetic_shape(model)) is not None:
        c = synthetic_config(shape)
        config = LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
            eos_token_id=list(c.eos_token_ids), pad_token_id=c.eos_token_ids[0],
        )
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return hf.to(device).eval()


def left_padded(prompts: list[list[int]], pad: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file or synthetic:NAME")
    p.add_argument("--device", default=None)
    p.add_argument("--prompts-json", required=True, help="a JSON list of prompt strings")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cache", default="static", choices=["static", "dynamic"])
    args = p.parse_args()

    device, dtype = device_and_dtype(args.device, None)
    tokenizer = load_model_tokenizer(args.model)
    texts = json.loads(Path(args.prompts_json).read_text())
    encoded = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
               for t in texts]
    model = load_hf_model(args.model, device, dtype)
    pad = tokenizer.eos_token_ids[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(ids: torch.Tensor, mask: torch.Tensor, n: int, temperature: float, cache: str | None) -> float:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature \
            else {"do_sample": False}
        if cache:
            kwargs["cache_implementation"] = cache
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=pad, **kwargs)
        sync()
        return time.perf_counter() - started

    cache = None if args.cache == "dynamic" else args.cache
    rows, n = [], args.max_tokens
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids, mask = left_padded([encoded[i % len(encoded)] for i in range(batch)], pad, device)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            # Warm-up at both lengths timed: a static cache is sized by max_new_tokens, and a size not seen
            # before recompiles the forward (session 19's batch-1 row timed 50 s of it for 32 tokens).
            for length in (n, 1):
                try:
                    timed(ids, mask, length, temperature, cache)
                except Exception as e:  # transformers refused the static cache: fall back, say so
                    print(f"hf_generate: cache {cache!r} failed ({type(e).__name__}: {e}); using dynamic",
                          file=sys.stderr)
                    cache = None
                    timed(ids, mask, length, temperature, cache)
            ttft = timed(ids, mask, 1, temperature, cache)
            full = timed(ids, mask, n, temperature, cache)
            rows.append({"batch": batch, "temperature": temperature, "tokens": batch * n, "seconds": full,
                         "tokens_per_s": batch * n / full, "ttft_ms": {"p50": 1e3 * ttft},
                         "tpot_ms": {"mean": 1e3 * (full - ttft) / (n - 1)} if n > 1 else None,
                         "cache": cache or "dynamic"})
    print(json.dumps({"model": args.model, "device": str(device), "dtype": str(dtype), "max_tokens": n,
                      "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
