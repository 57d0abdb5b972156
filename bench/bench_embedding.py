"""The embedding lookup as F.embedding (an index_select on CUDA) and as advanced indexing (weight[ids]),
inside CUDA graphs, at the row counts a step feeds: 1 and 16 (decode, a draft step), 5 and 80 (a verification
or a draft head's first step at k = 4), 320 and 2,048 (batch 64's verification, a prefill graph). Tables of
Llama-3.1-8B (128,256 x 4,096) and SmolLM2-135M (49,152 x 576), bf16. Both give the same rows (checked).

    python bench/bench_embedding.py --out bench/results/embedding_h100.json

Session 25 (bench/results/session25/embedding_6dcb9df_h100/, one H100): indexing saved 2-6 us at 5-16 rows,
cost 0.9 us at 1 row and matched F.embedding from 80 rows up: below what a round shows, so the models keep
F.embedding.
"""

import argparse
import datetime
import functools
import json
import platform

import torch
import torch.nn.functional as F
from bench_layer_ops import graph_time_us  # bench/ modules: scripts run as `python bench/<name>.py`
from specwire.drafter.train_eagle import code_commit

TABLES = {"llama-3.1-8b": (128256, 4096), "smollm2-135m": (49152, 576)}
ROWS = (1, 5, 16, 80, 320, 2048)


def gather(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows_out = []
    for name, (vocab, hidden) in TABLES.items():
        weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, device=device, generator=gen)
        for m in ROWS:
            ids = torch.randint(vocab, (m,), device=device, generator=gen)
            assert torch.equal(F.embedding(ids, weight), gather(ids, weight))
            index_select_us = graph_time_us(functools.partial(F.embedding, ids, weight))
            gather_us = graph_time_us(functools.partial(gather, ids, weight))
            rows_out.append({"table": name, "rows": m, "f_embedding_us": round(index_select_us, 2),
                             "indexing_us": round(gather_us, 2)})
            print(f"{name:<14}{m:>6}{index_select_us:>10.2f}{gather_us:>10.2f}")
    result = {"bench": "bench_embedding.py", "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "commit": code_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "timing": "CUDA graph of 20 calls, per call",
              "rows": rows_out}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
