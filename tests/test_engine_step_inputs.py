"""Host-side step inputs and outputs: verify rows that fill the grid are picked by a slice (no index copy),
CUDA-graph inputs go over from one pinned block, and reads back to the host through pinned memory."""

import pytest
import torch
from specwire.kernels.ops import follow_sampler_ref
from test_engine import close, tiny_checkpoint

from specwire.engine import TargetEngine
from specwire.staging import Readback, read_back

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def full_row_verify(device: str, cuda_graphs: bool):
    """Two prompts, then a verify step whose rows both feed 5 tokens (the captured width): its outputs, and
    the same positions from prefilling prompt + continuation in one go."""
    engine = TargetEngine(device=device, dtype=torch.float32, max_slots=4, max_context=64, aux_layers=(1,),
                          max_verify_tokens=5, cuda_graphs=cuda_graphs, checkpoint=tiny_checkpoint())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(512, (n,), generator=gen).tolist() for n in (9, 14)]
    conts = [torch.randint(512, (5,), generator=gen).tolist() for _ in prompts]
    refs = [engine.prefill([(2 + i, p + c)]) for i, (p, c) in enumerate(zip(prompts, conts, strict=True))]
    engine.prefill([(0, prompts[0]), (1, prompts[1])])
    out = engine.verify([0, 1], conts, [len(p) for p in prompts])
    return engine, out, refs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_full_verify_rows_agree_with_prefill(device):
    engine, out, refs = full_row_verify(device, cuda_graphs=True)
    assert out.logits.shape == (10, 512) and out.hidden.shape == out.aux_hidden.shape == (10, 128)
    for i, ref in enumerate(refs):
        rows = slice(5 * i, 5 * i + 5)
        assert close(out.hidden[rows], ref.hidden[-5:]) and close(out.aux_hidden[rows], ref.aux_hidden[-5:])
        assert close(out.logits[5 * i + 4], ref.logits[0])
    # What verify returned is the caller's: later steps (graph replays on CUDA) leave it alone.
    kept = out.logits.clone()
    engine.verify([3], [[1, 2, 3, 4, 5]], [30])
    engine.decode([3, 2], [7, 8], [35, 20])
    assert torch.equal(out.logits, kept)


@pytest.mark.gpu
@gpu
def test_graph_inputs_from_the_pinned_block_match_eager_step_after_step():
    """Steps of different shapes in a row reuse one pinned input block: each equals the eager step."""
    engine, _, _ = full_row_verify("cuda", cuda_graphs=True)
    steps = [([0, 1], [[5, 6], [7, 8, 9, 10, 11]], [14, 19]), ([1], [[12, 13, 14]], [24]),
             ([0, 1, 3], [[1], [2], [3]], [16, 27, 0])]
    for slots, rows, starts in steps:
        before = (engine.cache.k.clone(), engine.cache.v.clone())
        graph = engine.verify(slots, rows, starts)
        engine.cache.k.copy_(before[0])
        engine.cache.v.copy_(before[1])
        graphs, engine.graphs = engine.graphs, []
        eager = engine.verify(slots, rows, starts)
        engine.graphs = graphs
        assert close(graph.logits, eager.logits, 1e-5) and close(graph.hidden, eager.hidden, 1e-5)


@pytest.mark.gpu
@gpu
def test_readback_copies_through_one_reused_pinned_buffer():
    readback = Readback()
    tables = [torch.randn(6, 32, device="cuda"), torch.randn(3, 32, device="cuda"),
              torch.randn(40, 32, device="cuda"), torch.randn(5, 16, device="cuda").bfloat16()]
    for table in tables:
        readback.start(table)
        host = readback.wait()
        assert host.is_pinned() and host.dtype == table.dtype and torch.equal(host, table.cpu())
    cpu = torch.randn(4, 8)
    readback.start(cpu)
    assert readback.wait() is cpu


def test_read_back_leaves_host_tensors_alone():
    cpu = torch.arange(6).view(2, 3)
    assert read_back(cpu) is cpu


@pytest.mark.gpu
@gpu
def test_read_back_copies_through_pinned_memory():
    """Sliced and strided device tensors of several dtypes come back pinned and equal, including the result
    of work queued just before the read."""
    big = torch.randn(64, 64, device="cuda")
    for tensor in (big[:, 3:9], big.t()[::2], big.long()[5], (big > 0).sum(1).int(), big.bfloat16()[:7] * 3):
        host = read_back(tensor)
        assert host.is_pinned() and host.dtype == tensor.dtype and torch.equal(host, tensor.cpu())


@pytest.mark.parametrize("cuda_graphs", [False, pytest.param(True, marks=[pytest.mark.gpu, gpu])])
def test_drafts_already_on_the_device_feed_as_the_host_rows_do(cuda_graphs):
    """verify(device_drafts=...): rows give their first token and length, the drafts come as one device
    tensor (a co-located drafter's, never read back); the step equals the one fed the same rows from the
    host, where rows are shorter than the widest (written by an index) and where all are as wide (a strided
    copy)."""
    device = "cuda" if cuda_graphs else "cpu"
    engine, _, _ = full_row_verify(device, cuda_graphs=cuda_graphs)
    slots, starts = [0, 1, 3], [14, 19, 0]
    for rows in ([[5, 6, 7], [8, 9, 10, 11, 12], [13]], [[5, 6, 7], [8, 9, 10], [13, 14, 15]]):
        host = engine.verify(slots, rows, starts)
        drafts = torch.tensor([t for row in rows for t in row[1:]], device=device)
        placeholders = [[row[0], *[0] * (len(row) - 1)] for row in rows]
        fed = engine.verify(slots, placeholders, starts, device_drafts=drafts)
        assert torch.equal(fed.logits, host.logits) and torch.equal(fed.hidden, host.hidden)
        assert not torch.equal(engine.verify(slots, placeholders, starts).logits, host.logits)  # fed them
    with pytest.raises(ValueError, match="device_drafts must be"):
        engine.verify(slots, placeholders, starts, device_drafts=drafts[:-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_the_follow_kernel_sets_what_the_reference_sets(device):
    """follow_triton (on a CPU, Triton's interpreter) against the torch reference: rows that emitted 1 to
    k + 1 tokens, a row the sampler marked bad (count -1), a token out of the vocabulary (clamped); int64 ids
    beside int32 positions, as the engine's graph inputs are, with rows past the batch left alone."""
    follow_triton = pytest.importorskip("specwire.kernels.follow_triton")
    gen = torch.Generator().manual_seed(5)
    B, k, V = 7, 4, 512
    packed = torch.randint(V, (B, k + 2), generator=gen)
    packed[:, 0] = torch.tensor([1, 2, 5, 3, -1, 5, 4])
    packed[5, 5] = V + 9  # out of the vocabulary
    ids = torch.randint(V, (B + 2, k + 1), generator=gen)
    positions = torch.randint(100, (B + 2,), generator=gen, dtype=torch.int32)
    want_ids, want_positions = ids.clone(), positions.clone()
    follow_sampler_ref(want_ids, want_positions, packed, V)
    got_ids, got_positions = ids.clone().to(device), positions.clone().to(device)
    follow_triton.follow(got_ids, got_positions, packed.to(device), V)
    assert torch.equal(got_ids.cpu(), want_ids) and torch.equal(got_positions.cpu(), want_positions)
    assert want_ids[5, 0] == V - 1 and want_ids[4, 0] == packed[4, 1]
    assert want_positions[4] == positions[4] + 1 and want_positions[2] == positions[2] + 5
    assert torch.equal(want_ids[B:], ids[B:]) and not torch.equal(want_ids[:B], ids[:B])


@pytest.mark.parametrize("cuda_graphs", [False, pytest.param(True, marks=[pytest.mark.gpu, gpu])])
def test_rows_that_follow_a_sampler_on_the_device_feed_as_the_host_rows_do(cuda_graphs):
    """verify(follow=packed): each row starts with the last token a sampler emitted for it, at its start
    advanced by their count, both read from the sampler's output on the device (the launch that does not wait
    for the host to read the tokens); the step equals the one fed the same rows from the host. A row the
    sampler marked bad (count -1) feeds a valid id rather than an index error."""
    device = "cuda" if cuda_graphs else "cpu"
    engine, _, _ = full_row_verify(device, cuda_graphs=cuda_graphs)
    slots, starts = [0, 1, 3], [14, 19, 0]
    emitted = [[40, 41, 42], [43], [44, 45, 46, 47, 48]]  # accepted drafts + one token, per row
    packed = torch.full((3, 6), -1, dtype=torch.int64)
    for b, tokens in enumerate(emitted):
        packed[b, 0], packed[b, 1:1 + len(tokens)] = len(tokens), torch.tensor(tokens)
    drafts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    host = engine.verify(slots, [[t[-1], *d] for t, d in zip(emitted, drafts, strict=True)],
                         [s + len(t) for s, t in zip(starts, emitted, strict=True)])
    on_device = torch.tensor([t for d in drafts for t in d], device=device)
    fed = engine.verify(slots, [[0] * 5] * 3, starts, device_drafts=on_device, follow=packed.to(device))
    assert torch.equal(fed.logits, host.logits) and torch.equal(fed.hidden, host.hidden)
    packed[1, 0] = -1
    bad = engine.verify(slots, [[0] * 5] * 3, starts, device_drafts=on_device, follow=packed.to(device))
    assert torch.equal(bad.logits[:5], host.logits[:5]) and torch.isfinite(bad.logits).all()
    with pytest.raises(ValueError, match="follow must have a row per verified row"):
        engine.verify(slots, [[0] * 5] * 3, starts, device_drafts=on_device, follow=packed[:2].to(device))
