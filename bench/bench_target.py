"""Target-only decoding speed: specwire's engine vs transformers' generate() on the same weights, plus (on
CUDA) the CUDA-graph decode step time against the weight-bytes / copy-bandwidth floor.

    python bench/bench_target.py --device cpu --max-tokens 32 --out bench/results/target_cpu.json
    python bench/bench_target.py --device cuda --out bench/results/target_cuda.json
    python bench/bench_target.py --device cuda --synthetic llama-3.1-8b --out bench/results/target_8b.json

Decode tokens/s = batch * (N - 1) / (t(N tokens) - t(1 token)): the prefill and first token cancel out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from shapes import SHAPES  # bench/shapes.py: scripts run as `python bench/<name>.py`

from specwire.default_model import default_model_path
from specwire.engine import TargetEngine, default_dtype, device_scope, parse_device
from specwire.sampling_params import SamplingParams
from specwire.weights import checkpoint_shapes

PROMPTS = [
    "Explain how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "What is the capital of France and why is it famous?",
    "List three uses of a paperclip.",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "What are prime numbers? Give examples.",
    "Tell me a fun fact about octopuses.",
    "How does a compiler differ from an interpreter?",
    "Write a haiku about autumn leaves.",
    "What causes earthquakes?",
    "Explain photosynthesis to a child.",
    "Suggest a name for a small coffee shop.",
]

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def prompt_ids(tokenizer, batch: int) -> list[list[int]]:
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats]


def decode_rate(run, batch: int, max_tokens: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Best-of-repeats timings of run(n) for n = max_tokens and n = 1; decode tokens/s from the difference."""
    run(2)  # warm-up (kernel compilation, allocator)
    t_full = min(timed(lambda: run(max_tokens), device) for _ in range(repeats))
    t_one = min(timed(lambda: run(1), device) for _ in range(repeats))
    return {
        "seconds": t_full,
        "generate_tokens_per_s": batch * max_tokens / t_full,
        "decode_tokens_per_s": batch * (max_tokens - 1) / max(t_full - t_one, 1e-9),
    }


def bench_ours(engine: TargetEngine, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    def run(n: int) -> None:
        results = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)] * len(prompts))
        assert all(len(r.token_ids) == n for r in results)

    return decode_rate(run, len(prompts), max_tokens, engine.device, repeats)


def load_hf(model_path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def bench_hf(model, prompts: list[list[int]], max_tokens: int, device: torch.device, repeats: int) -> dict:
    """transformers generate(), greedy, default dynamic cache, left-padded batch, EOS suppressed."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def run(n: int) -> None:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + n

    return decode_rate(run, len(prompts), max_tokens, device, repeats)


def copy_bandwidth(device: torch.device, num_bytes: int = 2**30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * num_bytes * repeats / (start.elapsed_time(end) / 1e3)


def weight_bytes(engine: TargetEngine) -> int:
    """Bytes of every weight one decode step reads; parameters() yields a tied lm_head once."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def step_times(engine: TargetEngine, batches: list[int], context: int, repeats: int) -> dict[int, dict]:
    """CUDA-event timed decode steps at each batch size, every row at position `context`: graph replay
    alone, and an eager forward on the same inputs."""
    graphs = engine.graphs_for(max(batches), 1)
    results = {}
    for batch in batches:
        slots = torch.arange(batch, dtype=torch.int32, device=engine.device)
        tokens = torch.randint(engine.config.vocab_size, (batch,), device=engine.device)
        positions = torch.full((batch,), context, dtype=torch.int32, device=engine.device)
        ones = torch.ones(batch, dtype=torch.int32, device=engine.device)
        size = graphs.prepare(slots, tokens[:, None], ones, positions)

        def eager(size: int = size) -> None:
            engine.model(graphs.input_ids[:size], graphs.start_pos[:size], graphs.num_tokens[:size],
                         graphs.slots[:size], engine.cache)

        results[batch] = {
            "graph_ms": event_time(lambda size=size: graphs.replay(size), repeats),
            "eager_ms": event_time(eager, repeats),
        }
    return results


def event_time(fn, repeats: int) -> float:
    """Mean milliseconds per call over `repeats` back-to-back calls, after warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def synthetic_engine(name: str, device: torch.device, max_slots: int, max_context: int) -> TargetEngine:
    """Random bf16 weights with a real model's shapes, built on the device (nothing to download)."""
    config = SHAPES[name]
    shapes = checkpoint_shapes(config)
    gen = torch.Generator(device=device).manual_seed(0)
    state = {
        n: (torch.ones(s, dtype=torch.bfloat16, device=device) if len(s) == 1
            else 0.02 * torch.randn(s, dtype=torch.bfloat16, device=device, generator=gen))
        for n, s in shapes.items()
    }
    return TargetEngine(device=device, dtype=torch.bfloat16, max_slots=max_slots, max_context=max_context,
                        checkpoint=(config, state))


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs, {platform.platform()})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--synthetic", choices=sorted(SHAPES), help="random weights with these shapes (CUDA)")
    p.add_argument("--batches", default="1,16", help="generate() batch sizes")
    p.add_argument("--step-batches", default="1,16,64", help="decode-step batch sizes (CUDA)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=512, help="position of the timed decode steps (CUDA)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="generate() timings: best of this many")
    p.add_argument("--step-repeats", type=int, default=100)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args()

    device = parse_device(args.device)
    dtype = default_dtype(device)
    batches = [int(b) for b in args.batches.split(",")]
    step_batches = [int(b) for b in args.step_batches.split(",")] if device.type == "cuda" else []
    max_slots = max(batches + step_batches)
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine(device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "max_tokens": args.max_tokens,
    }

    if args.synthetic:
        if device.type != "cuda":
            raise SystemExit("--synthetic needs a CUDA device")
        engine = synthetic_engine(args.synthetic, device, max_slots, args.max_context)
        report["model"] = f"synthetic {args.synthetic} (random bf16 weights)"
    else:
        model_path = str(args.model or default_model_path())
        engine = TargetEngine(model_path, device, dtype, max_slots=max_slots, max_context=args.max_context)
        report["model"] = model_path
        generate_rows = []
        hf = None if args.no_hf else load_hf(model_path, dtype, device)
        for batch in batches:
            prompts = prompt_ids(engine.tokenizer, batch)
            row = {"batch": batch, "specwire": bench_ours(engine, prompts, args.max_tokens, args.repeats)}
            if hf is not None:
                row["transformers"] = bench_hf(hf, prompts, args.max_tokens, device, args.repeats)
            generate_rows.append(row)
        report["generate"] = generate_rows
        print(markdown_table(
            ["batch", "engine", "decode tok/s", "generate tok/s (incl. prefill)", "seconds"],
            [[r["batch"], name, f"{f['decode_tokens_per_s']:.1f}", f"{f['generate_tokens_per_s']:.1f}",
              f"{f['seconds']:.3f}"]
             for r in generate_rows for name, f in r.items() if name != "batch"],
        ))

    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        nbytes = weight_bytes(engine)
        floor_ms = nbytes / bandwidth * 1e3
        with device_scope(engine.device):  # the graphs' host-block copy and event live on the engine's GPU
            steps = step_times(engine, step_batches, args.context, args.step_repeats)
        report["decode_step"] = {
            "context": args.context, "weight_bytes": nbytes, "copy_bandwidth_bytes_per_s": bandwidth,
            "floor_ms": floor_ms, "steps": {str(b): s for b, s in steps.items()},
        }
        print(f"\nweights {nbytes / 1e6:.1f} MB, device copy bandwidth (read + write) "
              f"{bandwidth / 1e12:.2f} TB/s, floor {floor_ms * 1e3:.1f} us per step; "
              f"decode step at position {args.context}:")
        print(markdown_table(
            ["batch", "CUDA graph step (ms)", "eager step (ms)", "floor (ms)", "graph / floor"],
            [[b, f"{s['graph_ms']:.3f}", f"{s['eager_ms']:.3f}", f"{floor_ms:.3f}",
              f"{s['graph_ms'] / floor_ms:.1f}x"] for b, s in steps.items()],
        ))

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
