"""(GPU) After start-up no prompt makes Triton compile: the engine and the drafter compile every kernel
variant a prefill can pick while they start (capturing the prefill graphs, or warming up the eager widths
where there are none), so that no request (and no other request's stream) waits ~1 s on a compile
mid-serving, as the H200 runs showed (bench/results/session16_h200x2)."""

import pytest
import torch
from specwire.kernels import attention_triton, rope_triton
from test_drafter_proposer import Setup

from specwire.engine import TargetEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
KERNELS = (attention_triton._attention_kernel, rope_triton._rope_write_kv_kernel)


def compiled_variants() -> int:
    """Kernels Triton has compiled for the attention and RoPE kernels, all devices."""
    return sum(len(cache[0]) for kernel in KERNELS for cache in kernel.device_caches.values())


@pytest.mark.parametrize("prefill_graph_tokens", [0, 2048])  # every prefill eager; most by the graph
def test_engine_prefill_compiles_nothing_after_start_up(prefill_graph_tokens):
    engine = TargetEngine("synthetic:tiny", device="cuda", max_slots=4, max_context=512, max_verify_tokens=5,
                          prefill_graph_tokens=prefill_graph_tokens)
    before = compiled_variants()
    assert before > 0
    for lengths in ([3], [16], [32, 5], [48, 17, 200], [333], [1], [64, 64, 64, 64]):
        slots = [engine.allocate_slot() for _ in lengths]
        engine.prefill([(s, [7] * n) for s, n in zip(slots, lengths, strict=True)])
        for s in slots:
            engine.free_slot(s)
    torch.cuda.synchronize()
    assert compiled_variants() == before


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_drafter_prompts_compile_nothing_after_start_up(tmp_path, arch):
    setup = Setup(tmp_path, arch, device="cuda", max_requests=8)
    assert setup.proposer.graphs
    before = compiled_variants()
    for i, n in enumerate([3, 17, 33, 48, 64]):  # new prompts: by the prefill graph
        setup.add(f"r{i}", n)
    setup.proposer.propose([f"r{i}" for i in range(5)], [4] * 5, [0.0] * 5, [0] * 5)
    torch.cuda.synchronize()
    assert compiled_variants() == before
