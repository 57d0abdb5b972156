"""Layer ops: references vs independent formulations, Triton kernels vs references (CPU interpreter, CUDA).

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1, which must be set before triton
is first imported. When another test module imported triton first, the interpreter tests re-run here in a
fresh process instead.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from specwire.kernels import activation_triton, attention_triton, norm_triton, ops, rope_triton  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = isinstance(attention_triton._attention_kernel, InterpretedFunction)
on_interpreter = pytest.mark.skipif(not INTERPRETING, reason="triton compiles in this process (module doc)")
POISON = 1234.5


def on_cuda(test):
    """Marks a test `gpu`; it skips without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _interpreter_tol(dtype: torch.dtype) -> dict:
    """The interpreter casts float32 to bfloat16 by truncation (GPUs round to nearest): allow 2 ulp."""
    return dict(rtol=2**-5, atol=2**-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


def _cos_sin_table(num_positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _batch(num_tokens: list[int], start_pos: list[int], T: int, Hq: int, Hkv: int, D: int, C: int,
           num_slots: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> dict:
    """A random mixed batch; row b uses slot num_slots - 1 - b; the cache is random (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    B = len(num_tokens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {
        "q": rand(B, T, Hq, D), "k": rand(B, T, Hkv, D), "v": rand(B, T, Hkv, D),
        "k_cache": rand(num_slots + 1, Hkv, C, D), "v_cache": rand(num_slots + 1, Hkv, C, D),
        "slots": ints([num_slots - 1 - b for b in range(B)]), "start_pos": ints(start_pos),
        "num_tokens": ints(num_tokens),
        "positions": (ints(start_pos)[:, None] + torch.arange(T, device=device)).long(),
    }


def _cache_args(c: dict) -> tuple:
    return c["k_cache"], c["v_cache"], c["slots"], c["start_pos"], c["num_tokens"]


def _attention_by_sdpa(q, k_cache, v_cache, slots, start_pos, num_tokens, scale) -> torch.Tensor:
    """Obviously-correct GQA: per row, gather the visible keys and call SDPA with an explicit mask."""
    B, T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float32)
    for b in range(B):
        n, start, slot = int(num_tokens[b]), int(start_pos[b]), int(slots[b])
        if n == 0:
            continue
        keys = k_cache[slot, :, : start + n].float().repeat_interleave(group, dim=0)  # [Hq, L, D]
        values = v_cache[slot, :, : start + n].float().repeat_interleave(group, dim=0)
        mask = torch.arange(start + n)[None, :] <= start + torch.arange(n)[:, None]
        rows = F.scaled_dot_product_attention(q[b, :n].float().transpose(0, 1), keys, values,
                                              attn_mask=mask, scale=scale)
        out[b, :n] = rows.transpose(0, 1)
    return out


def _live(cache: torch.Tensor) -> torch.Tensor:
    """Every slot but the trash slot (whose contents padded tokens overwrite in any order)."""
    return cache[:-1]


MIXED_ROWS = {"num_tokens": [3, 0, 5, 1], "start_pos": [4, 7, 0, 11]}
ATTENTION_CASES = {  # name: (batch kwargs, scale)
    "verify_gqa3": (dict(MIXED_ROWS, T=5, Hq=6, Hkv=2, D=64, C=24, num_slots=5), 0.125),
    "decode": (dict(num_tokens=[1, 1, 0, 1], start_pos=[0, 23, 9, 70], T=1, Hq=8, Hkv=2, D=64, C=72,
                    num_slots=4), 0.125),
    "prefill_block128": (dict(num_tokens=[40, 17, 0], start_pos=[3, 20, 0], T=40, Hq=6, Hkv=2, D=64, C=64,
                              num_slots=3), 0.2),
}


# ------------------------------------------------------------------ references vs independent formulations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_transformers(dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
        expected = hf(x)
    torch.testing.assert_close(ops.rms_norm_ref(x, hf.weight.detach(), 1e-5), expected)


def test_add_rms_norm_ref_returns_sum_and_its_norm():
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    normed, new_residual = ops.add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(new_residual, x + r)
    torch.testing.assert_close(normed, ops.rms_norm_ref(x + r, w, 1e-6))


def test_rope_ref_matches_transformers():
    B, T, Hq, Hkv, D = 2, 6, 4, 2, 64
    q, k = torch.randn(B, T, Hq, D), torch.randn(B, T, Hkv, D)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [17, 18, 19, 40, 41, 2]])
    table = _cos_sin_table(64, D)
    half = table[positions]
    cos = torch.cat([half[..., : D // 2]] * 2, dim=-1)
    sin = torch.cat([half[..., D // 2:]] * 2, dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    q_rot, k_rot = ops.rope_ref(q, k, positions, table)
    torch.testing.assert_close(q_rot, q_hf)
    torch.testing.assert_close(k_rot, k_hf)


def test_write_kv_ref_writes_live_tokens_and_sends_padding_to_trash():
    c = _batch(**MIXED_ROWS, T=5, Hq=4, Hkv=2, D=64, C=32, num_slots=6)
    k_cache, v_cache = c["k_cache"].fill_(POISON), c["v_cache"].fill_(POISON)
    ops.write_kv_ref(k_cache, v_cache, c["k"], c["v"], c["slots"], c["start_pos"], c["num_tokens"])
    expected_k = torch.full_like(k_cache, POISON)
    for b, (n, start) in enumerate(zip(MIXED_ROWS["num_tokens"], MIXED_ROWS["start_pos"], strict=True)):
        expected_k[int(c["slots"][b]), :, start: start + n] = c["k"][b, :n].transpose(0, 1)
    torch.testing.assert_close(_live(k_cache), _live(expected_k))
    assert (_live(v_cache) != POISON).sum() == sum(MIXED_ROWS["num_tokens"]) * 2 * 64


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_ref_matches_per_row_sdpa(case):
    kwargs, scale = ATTENTION_CASES[case]
    c = _batch(**kwargs)
    out = ops.attention_ref(c["q"], *_cache_args(c), scale)
    torch.testing.assert_close(out, _attention_by_sdpa(c["q"], *_cache_args(c), scale), atol=1e-5, rtol=1e-5)
    padded = torch.arange(kwargs["T"])[None, :] >= c["num_tokens"][:, None]
    assert out[padded].abs().max() == 0


def test_silu_and_mul_ref():
    x = torch.randn(3, 2, 48)
    gate, up = x[..., :24], x[..., 24:]
    torch.testing.assert_close(ops.silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up)


def test_public_ops_run_the_references_on_cpu():
    c = _batch(**MIXED_ROWS, T=5, Hq=6, Hkv=2, D=64, C=24, num_slots=5)
    torch.testing.assert_close(ops.attention(c["q"], *_cache_args(c), 0.125),
                               ops.attention_ref(c["q"], *_cache_args(c), 0.125))


# ------------------------------------------------------------------ Triton kernels on CPU (interpreter)


@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="the interpreter tests run in-process")
def test_triton_kernels_in_a_fresh_interpreter_process():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton_cpu"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


@on_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cpu_norms(dtype):
    x, r, w = torch.randn(7, 576).to(dtype), torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    tol = _interpreter_tol(dtype)
    torch.testing.assert_close(norm_triton.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5), **tol)
    normed, new_residual = norm_triton.add_rms_norm(x, r, w, 1e-5)
    normed_ref, new_residual_ref = ops.add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(new_residual, new_residual_ref, **tol)
    torch.testing.assert_close(normed, normed_ref, **tol)


@on_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cpu_silu_and_mul(dtype):
    x = torch.randn(3, 5, 96).to(dtype)
    tol = _interpreter_tol(dtype)
    torch.testing.assert_close(activation_triton.silu_and_mul(x), ops.silu_and_mul_ref(x), **tol)


@on_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cpu_rope_clamps_positions_like_the_reference(dtype):
    c = _batch(**MIXED_ROWS, T=5, Hq=6, Hkv=2, D=64, C=24, num_slots=5, dtype=dtype)
    table = _cos_sin_table(14, 64)  # positions reach 15: padded tokens beyond the table are clamped
    q_rot, k_rot = rope_triton.rope(c["q"], c["k"], c["positions"], table)
    q_ref, k_ref = ops.rope_ref(c["q"], c["k"], c["positions"], table)
    torch.testing.assert_close(q_rot, q_ref, **_interpreter_tol(dtype))
    torch.testing.assert_close(k_rot, k_ref, **_interpreter_tol(dtype))


@on_interpreter
def test_triton_cpu_rope_write_kv_from_fused_qkv_views():
    c = _batch(**MIXED_ROWS, T=5, Hq=6, Hkv=2, D=64, C=24, num_slots=5)
    qkv = torch.randn(4, 5, (6 + 2 + 2) * 64)
    q, k, v = (t.unflatten(-1, (-1, 64)) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], dim=-1))
    table = _cos_sin_table(32, 64)
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    q_rot = rope_triton.rope_write_kv(q, k, v, c["positions"], table, k_cache, v_cache, *_cache_args(c)[2:])
    q_ref = ops.rope_write_kv_ref(q, k, v, c["positions"], table, *_cache_args(c))
    torch.testing.assert_close(q_rot, q_ref)
    torch.testing.assert_close(_live(k_cache), _live(c["k_cache"]))
    torch.testing.assert_close(_live(v_cache), _live(c["v_cache"]))


@on_interpreter
def test_triton_cpu_write_kv_padding_never_touches_a_live_slot():
    # Row 1 is padding that still names live slot 2; row 3's second token would overflow the cache.
    c = _batch(num_tokens=[3, 0, 5, 2], start_pos=[4, 2, 0, 23], T=5, Hq=4, Hkv=2, D=64, C=24, num_slots=4)
    c["k_cache"].fill_(POISON)
    c["v_cache"].fill_(POISON)
    expected_k, expected_v = c["k_cache"].clone(), c["v_cache"].clone()
    ops.write_kv_ref(expected_k, expected_v, c["k"], c["v"], *_cache_args(c)[2:])
    rope_triton.write_kv(*_cache_args(c)[:2], c["k"], c["v"], *_cache_args(c)[2:])
    torch.testing.assert_close(_live(c["k_cache"]), _live(expected_k))
    torch.testing.assert_close(_live(c["v_cache"]), _live(expected_v))
    assert (c["k_cache"][int(c["slots"][1])] == POISON).all()
    assert (c["k_cache"][int(c["slots"][3]), :, 20:] != POISON).sum() == 2 * 64  # position 23 only


@on_interpreter
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_triton_cpu_attention(case):
    kwargs, scale = ATTENTION_CASES[case]
    c = _batch(**kwargs)
    out = attention_triton.attention(c["q"], *_cache_args(c), scale)
    torch.testing.assert_close(out, ops.attention_ref(c["q"], *_cache_args(c), scale), atol=1e-5, rtol=1e-5)


@on_interpreter
def test_triton_cpu_attention_reads_no_key_beyond_the_valid_length():
    kwargs, scale = ATTENTION_CASES["verify_gqa3"]
    c = _batch(**kwargs)
    expected = ops.attention_ref(c["q"], *_cache_args(c), scale)
    for b, (n, start) in enumerate(zip(kwargs["num_tokens"], kwargs["start_pos"], strict=True)):
        for cache in (c["k_cache"], c["v_cache"]):
            cache[int(c["slots"][b]), :, start + n:] = float("nan")
    out = attention_triton.attention(c["q"], *_cache_args(c), scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("head_dim, elem_bytes", [(64, 2), (128, 2), (64, 4), (128, 4)])
def test_attention_tiles_do_not_depend_on_the_rows_a_launch_holds(head_dim, elem_bytes):
    """A query row's arithmetic must not depend on how many rows share its launch (decode, verify, prefill,
    a prompt carried by a verification): one key-block length, and 16 query rows per warp in every tile (a
    prefill's 128-row tile is two of the 64-row ones). On a GPU, test_carried_prompts checks the bits."""
    configs = {attention_triton._launch_config(head_dim, elem_bytes, m) for m in range(1, 600)}
    assert len({block_n for _, block_n, _, _ in configs}) == 1
    assert {block_m // warps for block_m, _, warps, _ in configs} == {16}
    assert {block_m for block_m, _, _, _ in configs} == {64, 128}


# ------------------------------------------------------------------ Triton kernels on CUDA, real shapes

GPU_SHAPES = {  # name: (hidden, intermediate, Hq, Hkv, D)
    "smollm2": (576, 1536, 9, 3, 64),
    "llama8b": (4096, 14336, 32, 8, 128),
}
GPU_TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
GPU_ATTENTION_MODES = {  # name: (num_tokens, start_pos, T, C)
    "decode_long": ([1, 1, 0, 1, 1], [0, 4095, 17, 2048, 777], 1, 4096),
    "verify": ([5, 3, 0, 1, 5, 2], [100, 0, 9, 511, 300, 40], 5, 520),
    "prefill": ([300, 1, 0, 128], [0, 50, 0, 200], 300, 512),
}
dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
shapes = pytest.mark.parametrize("shape", GPU_SHAPES)


@on_cuda
@shapes
@dtypes
def test_gpu_norms_and_silu(shape, dtype):
    hidden, inter = GPU_SHAPES[shape][:2]
    x, r = (torch.randn(37, hidden, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    # One bf16 ulp may flip where the float32 sums round differently.
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5), **GPU_TOL[dtype])
    for got, want in zip(ops.add_rms_norm(x, r, w, 1e-5), ops.add_rms_norm_ref(x, r, w, 1e-5), strict=True):
        torch.testing.assert_close(got, want, **GPU_TOL[dtype])
    gate_up = torch.randn(37, 2 * inter, device="cuda", dtype=dtype)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ops.silu_and_mul_ref(gate_up), **GPU_TOL[dtype])


@on_cuda
@shapes
@dtypes
def test_gpu_rope_write_kv(shape, dtype):
    _, _, Hq, Hkv, D = GPU_SHAPES[shape]
    c = _batch(**MIXED_ROWS, T=5, Hq=Hq, Hkv=Hkv, D=D, C=64, num_slots=6, dtype=dtype, device="cuda")
    table = _cos_sin_table(64, D).cuda()
    q_rot, k_rot = ops.rope(c["q"], c["k"], c["positions"], table)
    q_ref, k_ref = ops.rope_ref(c["q"], c["k"], c["positions"], table)
    torch.testing.assert_close(q_rot, q_ref, **GPU_TOL[dtype])
    torch.testing.assert_close(k_rot, k_ref, **GPU_TOL[dtype])
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    q_out = ops.rope_write_kv(c["q"], c["k"], c["v"], c["positions"], table, k_cache, v_cache,
                              *_cache_args(c)[2:])
    q_out_ref = ops.rope_write_kv_ref(c["q"], c["k"], c["v"], c["positions"], table, *_cache_args(c))
    torch.testing.assert_close(q_out, q_out_ref, **GPU_TOL[dtype])
    torch.testing.assert_close(_live(k_cache), _live(c["k_cache"]), **GPU_TOL[dtype])
    torch.testing.assert_close(_live(v_cache), _live(c["v_cache"]), rtol=0, atol=0)


@on_cuda
@shapes
@dtypes
@pytest.mark.parametrize("mode", GPU_ATTENTION_MODES)
def test_gpu_attention(shape, dtype, mode):
    _, _, Hq, Hkv, D = GPU_SHAPES[shape]
    num_tokens, start_pos, T, C = GPU_ATTENTION_MODES[mode]
    c = _batch(num_tokens, start_pos, T=T, Hq=Hq, Hkv=Hkv, D=D, C=C, num_slots=len(num_tokens) + 1,
               dtype=dtype, device="cuda")
    out = ops.attention(c["q"], *_cache_args(c), D**-0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ops.attention_ref(c["q"], *_cache_args(c), D**-0.5), **GPU_TOL[dtype])


@on_cuda
def test_gpu_attention_replays_in_a_cuda_graph_with_new_lengths():
    _, _, Hq, Hkv, D = GPU_SHAPES["smollm2"]
    c = _batch([5, 2, 0], [10, 0, 3], T=5, Hq=Hq, Hkv=Hkv, D=D, C=600, num_slots=4, dtype=torch.bfloat16,
               device="cuda")
    ops.attention(c["q"], *_cache_args(c), 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.attention(c["q"], *_cache_args(c), 0.125)
    c["start_pos"].copy_(torch.tensor([590, 300, 0], dtype=torch.int32))
    c["num_tokens"].copy_(torch.tensor([3, 5, 1], dtype=torch.int32))
    graph.replay()
    expected = ops.attention_ref(c["q"], *_cache_args(c), 0.125)
    torch.testing.assert_close(out, expected, **GPU_TOL[torch.bfloat16])


@on_cuda
def test_gpu_torch_ops_env_var_selects_the_reference(monkeypatch):
    x = torch.randn(4, 2 * 96, device="cuda")
    monkeypatch.setenv("SPECWIRE_TORCH_OPS", "1")
    assert not ops._triton_enabled(x)
    monkeypatch.setenv("SPECWIRE_TORCH_OPS", "0")
    assert ops._triton_enabled(x)
