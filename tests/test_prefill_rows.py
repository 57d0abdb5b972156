"""Prefill cut into rows (engine.PrefillRows), the layout of the prefill CUDA graph: the rows of a prompt
fed in one forward are its causal prefill, whatever else shares the grid. On the CPU the model runs that
grid eagerly against the engine's own prefill; on CUDA the graph replay runs against the eager prefill."""

import numpy as np
import pytest
import torch
from test_engine import close, tiny_checkpoint

from specwire.engine import PREFILL_ROW, TargetEngine, prefill_rows


def random_prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(512, (n,), generator=gen).tolist() for n in lengths]


def test_rows_layout():
    rows = prefill_rows([(3, list(range(1, 6))), (0, list(range(10, 140))), (5, [7])], 64)
    assert rows.slots == [3, 0, 0, 0, 5]
    assert rows.starts == [0, 0, 64, 128, 0]
    assert rows.counts == [5, 64, 64, 2, 1]
    assert rows.last_rows == [0, 3, 4]
    assert rows.cells == [*range(5), *range(64, 194), 256]
    assert rows.tokens.shape == (5, 64)
    assert rows.tokens[3, :3].tolist() == [138, 139, 0] and rows.tokens[4, 0] == 7
    # every prompt token sits in its cell, in order
    assert rows.tokens.reshape(-1)[rows.cells].tolist() == [*range(1, 6), *range(10, 140), 7]


@pytest.mark.parametrize("width", [16, 64])
def test_rows_in_one_forward_are_the_prefill(width):
    """Eager, on the CPU (the reference attention): the grid of rows, one forward, gives the prefill's
    logits at each last token, its hidden and aux rows and the same keys and values in the cache."""
    engine = TargetEngine(device="cpu", dtype=torch.float32, max_slots=4, max_context=256, cuda_graphs=False,
                          aux_layers=(1,), checkpoint=tiny_checkpoint())
    requests = list(zip([2, 0, 3, 1], random_prompts([5, 130, 64, 1]), strict=True))
    reference = engine.prefill(requests)
    k, v = engine.cache.k.clone(), engine.cache.v.clone()
    engine.cache.k.zero_()
    engine.cache.v.zero_()

    rows = prefill_rows(requests, width)
    last = [r * width + rows.counts[r] - 1 for r in rows.last_rows]
    starts, counts, slots = (torch.tensor(x, dtype=torch.int32)
                             for x in (rows.starts, rows.counts, rows.slots))
    out = engine.model(torch.from_numpy(rows.tokens), starts, counts, slots, engine.cache,
                       logits_index=torch.tensor(last), aux_layers=(1,))
    assert close(out.logits, reference.logits, 1e-5)
    assert close(out.hidden.flatten(0, 1)[rows.cells], reference.hidden, 1e-5)
    assert close(out.aux_hidden.flatten(0, 1)[rows.cells], reference.aux_hidden, 1e-5)
    for slot, prompt in requests:
        assert close(engine.cache.k[:, slot, :, :len(prompt)], k[:, slot, :, :len(prompt)], 1e-5)
        assert close(engine.cache.v[:, slot, :, :len(prompt)], v[:, slot, :, :len(prompt)], 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graph_matches_eager():
    """The prefill graph (prompts cut into rows of PREFILL_ROW, padded to a captured number of rows) gives
    what the eager prefill gives, touches no other slot, and hands back tensors the next replay leaves alone;
    a prefill of more rows than the largest graph runs eagerly."""
    engine = TargetEngine(device="cuda", dtype=torch.float32, max_slots=8, max_context=256, aux_layers=(1,),
                          max_verify_tokens=5, checkpoint=tiny_checkpoint(),
                          prefill_graph_tokens=8 * PREFILL_ROW)
    assert engine.prefill_graphs.sizes == [1, 2, 4, 8]
    lengths = [5, 130, 64, 1, 65]  # 1 + 3 + 1 + 1 + 2 rows: padded to 8
    requests = list(zip([6, 0, 3, 1, 4], random_prompts(lengths), strict=True))
    assert engine.prefill_graph_fits(lengths) and not engine.prefill_graph_fits([200, 200, 200])
    before = (engine.cache.k.clone(), engine.cache.v.clone())

    graph = engine.prefill(requests)
    after_graph = (engine.cache.k.clone(), engine.cache.v.clone())
    engine.cache.k.copy_(before[0])
    engine.cache.v.copy_(before[1])
    eager = engine._prefill_eager(requests)

    assert graph.logits.shape == eager.logits.shape == (5, 512)
    assert close(graph.logits, eager.logits, 1e-5) and close(graph.hidden, eager.hidden, 1e-5)
    assert close(graph.aux_hidden, eager.aux_hidden, 1e-5)
    for slot, prompt in requests:
        assert close(after_graph[0][:, slot, :, :len(prompt)], engine.cache.k[:, slot, :, :len(prompt)], 1e-5)
    untouched = [s for s in range(engine.max_slots) if s not in [slot for slot, _ in requests]]
    assert torch.equal(after_graph[0][:, untouched], before[0][:, untouched])
    assert torch.equal(after_graph[1][:, untouched], before[1][:, untouched])

    kept = graph.logits.clone()
    engine.prefill([(5, [9, 8, 7])])
    assert torch.equal(graph.logits, kept)
    assert np.isfinite(engine.prefill([(s, [1] * 200) for s in (2, 5, 7)]).logits.cpu().numpy()).all()
