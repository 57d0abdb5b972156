"""Writes a copy of an EAGLE head whose MLP and/or attention are widened in place (drafter.eagle_head:
widen_mlp, widen_attention): it drafts exactly what the head drafts, so a demo or a benchmark with it
measures what the wider layer alone costs at the same acceptance. The target gives the shared embedding and
lm_head.

    python bench/widen_head.py --head drafter_service/heads/smollm2-135m-eagle --intermediate-size 3072 \
        --attention-heads 18 --out /tmp/wide-head
"""

from __future__ import annotations

import argparse

import torch
from specwire.drafter.eagle_head import load_eagle_head, save_eagle_head, widen_attention, widen_mlp

from specwire.default_model import resolve_model_path
from specwire.weights import load_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True)
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--intermediate-size", type=int, default=0, help="the MLP's new width (0: as it is)")
    p.add_argument("--attention-heads", type=int, default=0, help="the new query heads (0: as it is)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config, weights = load_checkpoint(resolve_model_path(args.model))
    shared = {k: v for k, v in weights.items() if k in ("model.embed_tokens.weight", "lm_head.weight")}
    head = load_eagle_head(args.head, config, shared, torch.float32, "cpu")
    layer = head.config.layer
    wide = widen_mlp(head, args.intermediate_size, shared) if args.intermediate_size else head
    wide = widen_attention(wide, args.attention_heads, shared) if args.attention_heads else wide
    save_eagle_head(wide, args.out)
    new = wide.config.layer
    print(f"{args.head}: MLP {layer.intermediate_size} -> {new.intermediate_size}, attention heads "
          f"{layer.num_heads} / {layer.num_kv_heads} -> {new.num_heads} / {new.num_kv_heads}, "
          f"written to {args.out}")


if __name__ == "__main__":
    main()
