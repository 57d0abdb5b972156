"""`specwire generate`: target-only generation in-process (no services, no drafter)."""

from __future__ import annotations

import argparse
import json
import sys

from specwire.sampling_params import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling flags, shared with `specwire client`."""
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1] (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    parser.add_argument("--stop", action="append", default=[], metavar="STR",
                        help="stop when the text contains STR (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    params.validate()  # fail before loading the model; the engine re-checks against the vocabulary
    return params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true", help="use the chat template (one user message)")
    add_sampling_arguments(parser)
    parser.add_argument("--model", default=None, help="GGUF file or HF model dir (default: SmolLM2)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                        help="weights and KV cache (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="KV-cache positions (default: min(2048, the model's maximum))")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the decode step eagerly")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from specwire.engine import TargetEngine  # torch and the model load only once the flags are valid

    params = sampling_params_from_args(args)
    prompt_ids = parse_token_ids(args.prompt_ids) if args.prompt_ids is not None else None
    engine = TargetEngine(args.model, args.device, args.dtype, max_slots=1, max_context=args.max_context,
                          cuda_graphs=not args.no_cuda_graphs)
    if prompt_ids is None:
        tokenizer = engine.tokenizer
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)  # the template holds them
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    result = engine.generate([prompt_ids], [params])[0]
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": result.stats}))
    else:
        print(result.text)
        s = result.stats
        print(f"[{s['tokens']} tokens in {s['seconds']:.2f} s, {s['tokens_per_s']:.1f} tokens/s, "
              f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0
