"""Micro-benchmark of the Llama layer ops: Triton kernels vs the PyTorch references, inside CUDA graphs.

For SmolLM2-135M and Llama-3.1-8B shapes, batch 1 and 64, decode (T=1) and verify (T=5) at context 512:
each op alone, and one whole decoder layer (the ops plus the four bf16 GEMMs), with its kernel count.
Times are per call, replayed from a CUDA graph (the engine's decode path), so launch overhead is included.

    python bench/bench_layer_ops.py --out bench/results/layer_ops.json
"""

import argparse
import json
import math
import os
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from shapes import SHAPES  # bench/shapes.py: scripts run as `python bench/<name>.py`
from specwire.kernels import ops
from torch.profiler import ProfilerActivity, profile

MODES = {"decode": 1, "verify": 5}  # new tokens per row
CONTEXT = 512  # keys each row attends to after this step
CAPACITY = 1024  # cache positions per slot: the references read all of them
EPS = 1e-5


def graph_time_us(fn: Callable[[], object], reps: int = 20, replays: int = 10) -> float:
    """Mean time of one fn() call, replayed from a CUDA graph that holds `reps` calls."""
    fn()  # compile / warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def kernel_count(fn: Callable[[], object]) -> int:
    """GPU kernels one eager fn() call launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("Memcpy") and not e.name.startswith("Memset"))


class Layer:
    """One decoder layer's tensors for a (shape, batch, T) case; `run(impl)` is one layer forward."""

    def __init__(self, shape: str, batch: int, T: int, dtype: torch.dtype = torch.bfloat16):
        c = SHAPES[shape]
        hidden, inter = c.hidden_size, c.intermediate_size
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        dev = "cuda"

        def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*size, device=dev) * scale).to(dtype)

        self.Hq, self.Hkv, self.D, self.T = Hq, Hkv, D, T
        self.x, self.residual = rand(batch, T, hidden), rand(batch, T, hidden)
        self.w_norm = rand(hidden)
        self.w_qkv = rand((Hq + 2 * Hkv) * D, hidden, scale=hidden**-0.5)
        self.w_o = rand(hidden, Hq * D, scale=(Hq * D) ** -0.5)
        self.w_gate_up = rand(2 * inter, hidden, scale=hidden**-0.5)
        self.w_down = rand(hidden, inter, scale=inter**-0.5)
        self.k_cache = rand(batch + 1, Hkv, CAPACITY, D)
        self.v_cache = rand(batch + 1, Hkv, CAPACITY, D)
        self.slots = torch.arange(batch, device=dev, dtype=torch.int32)
        self.start_pos = torch.full((batch,), CONTEXT - T, device=dev, dtype=torch.int32)
        self.num_tokens = torch.full((batch,), T, device=dev, dtype=torch.int32)
        self.positions = self.start_pos[:, None].long() + torch.arange(T, device=dev)
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D)
        angles = torch.arange(CAPACITY, device=dev).float()[:, None] * inv_freq
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.qkv = F.linear(self.x, self.w_qkv)
        self.q, self.k, self.v = self.split_qkv(self.qkv)
        self.gate_up = rand(batch, T, 2 * inter)
        self.scale = D**-0.5

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sizes = [self.Hq * self.D, self.Hkv * self.D, self.Hkv * self.D]
        return tuple(t.unflatten(-1, (-1, self.D)) for t in qkv.split(sizes, dim=-1))

    def cache_args(self) -> tuple:
        return self.k_cache, self.v_cache, self.slots, self.start_pos, self.num_tokens

    def op_calls(self, impl: dict[str, Callable]) -> dict[str, Callable[[], object]]:
        return {
            "add_rms_norm": lambda: impl["add_rms_norm"](self.x, self.residual, self.w_norm, EPS),
            "rope_write_kv": lambda: impl["rope_write_kv"](
                self.q, self.k, self.v, self.positions, self.cos_sin, *self.cache_args()),
            "attention": lambda: impl["attention"](self.q, *self.cache_args(), self.scale),
            "silu_and_mul": lambda: impl["silu_and_mul"](self.gate_up),
        }

    def run(self, impl: dict[str, Callable]) -> torch.Tensor:
        h, residual = impl["add_rms_norm"](self.x, self.residual, self.w_norm, EPS)
        q, k, v = self.split_qkv(F.linear(h, self.w_qkv))
        q = impl["rope_write_kv"](q, k, v, self.positions, self.cos_sin, *self.cache_args())
        attn = impl["attention"](q, *self.cache_args(), self.scale)
        h, residual = impl["add_rms_norm"](F.linear(attn.flatten(-2), self.w_o), residual, self.w_norm, EPS)
        return F.linear(impl["silu_and_mul"](F.linear(h, self.w_gate_up)), self.w_down)


OP_NAMES = ("add_rms_norm", "rope_write_kv", "attention", "silu_and_mul")
IMPLS = {
    "triton": {name: getattr(ops, name) for name in OP_NAMES},
    "torch": {name: getattr(ops, f"{name}_ref") for name in OP_NAMES},
}


def bench_case(shape: str, batch: int, mode: str) -> list[dict]:
    """Rows for every op and the whole layer of one (shape, batch, mode); prints them as it goes."""
    layer = Layer(shape, batch, MODES[mode])
    timings = {impl: {op: graph_time_us(call) for op, call in layer.op_calls(IMPLS[impl]).items()}
               for impl in IMPLS}
    kernels = {}
    for impl, funcs in IMPLS.items():
        timings[impl]["layer"] = graph_time_us(lambda funcs=funcs: layer.run(funcs))
        kernels[impl] = kernel_count(lambda funcs=funcs: layer.run(funcs))
    rows = []
    for op in timings["triton"]:
        tri, ref = timings["triton"][op], timings["torch"][op]
        print(f"{shape:<14}{batch:>4} {mode:<7}{op:<15}{tri:>10.1f}{ref:>10.1f}{ref / tri:>8.2f}x")
        rows.append({"shape": shape, "batch": batch, "mode": mode, "tokens_per_row": MODES[mode], "op": op,
                     "triton_us": round(tri, 2), "torch_us": round(ref, 2)})
    rows[-1]["kernels_per_layer"] = kernels
    print(f"{'':<26}kernels per layer: triton {kernels['triton']}, torch {kernels['torch']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_ops needs CUDA")
    os.environ.pop("SPECWIRE_TORCH_OPS", None)
    header = f"{'shape':<14}{'bs':>4} {'mode':<7}{'op':<15}{'triton us':>10}{'torch us':>10}{'speedup':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for shape in SHAPES:
        for batch in args.batches:
            for mode in MODES:
                rows += bench_case(shape, batch, mode)
                torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "context": CONTEXT, "cache_capacity": CAPACITY,
        "dtype": "bfloat16", "timing": "CUDA graph replay, per call", "rows": rows,
        "smollm2_30_layers_decode_bs1_ms": next(
            (round(30 * r["triton_us"] / 1e3, 3) for r in rows if r["shape"] == "smollm2-135m"
             and r["batch"] == 1 and r["mode"] == "decode" and r["op"] == "layer"), math.nan),
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
