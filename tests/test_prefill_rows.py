"""Prefill cut into rows (engine.PrefillRows), the layout of every prefill forward: the rows of a prompt fed
in one forward or several in order are its causal prefill, whatever else shares the grid. On the CPU the
engine's prefill runs against each prompt's own forward; on CUDA the graph replays against eager forwards."""

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


def test_chunks_split_the_grid_in_order():
    rows = prefill_rows([(3, list(range(1, 6))), (0, list(range(10, 140))), (5, [7])], 64)
    chunks = rows.chunks(2)
    assert [c.slots for c in chunks] == [[3, 0], [0, 0], [5]]
    assert [c.starts for c in chunks] == [[0, 0], [64, 128], [0]]
    assert [c.last_rows for c in chunks] == [[0], [1], [0]]  # prompt 1 ends in the second chunk
    # each chunk's cells are its own tokens, renumbered: joined, they are the grid's token order
    assert [len(c.cells) for c in chunks] == [69, 66, 1]
    joined = np.concatenate([c.tokens.reshape(-1)[c.cells] for c in chunks])
    assert joined.tolist() == rows.tokens.reshape(-1)[rows.cells].tolist()
    whole, = rows.chunks(64)
    assert (whole.slots, whole.last_rows, whole.cells) == (rows.slots, rows.last_rows, rows.cells)


def prefill_one_by_one(engine: TargetEngine, requests: list[tuple[int, list[int]]]):
    """The reference: each prompt alone as one row of its own length, one forward each."""
    outs = []
    for slot, ids in requests:
        n = len(ids)
        start, count, slots = (torch.tensor([x], dtype=torch.int32) for x in (0, n, slot))
        outs.append(engine.model(torch.tensor([ids]), start, count, slots, engine.cache,
                                 logits_index=torch.tensor([n - 1]), aux_layers=engine.aux_layers))
    return (torch.cat([o.logits for o in outs]), torch.cat([o.hidden[0] for o in outs]),
            torch.cat([o.aux_hidden[0] for o in outs]))


@pytest.mark.parametrize("max_prefill_tokens", [64, 2 * 64, 8192])
def test_prefill_in_rows_is_the_prefill(max_prefill_tokens):
    """Eager, on the CPU (the reference attention): prompts cut into rows of PREFILL_ROW, one forward or a few
    (max_prefill_tokens: 1, 2 or all rows a forward, a prompt cut across forwards), give each prompt's own
    forward's logits at its last token, its hidden and aux rows and the same keys and values in the cache."""
    engine = TargetEngine(device="cpu", dtype=torch.float32, max_slots=4, max_context=256, cuda_graphs=False,
                          aux_layers=(1,), checkpoint=tiny_checkpoint(),
                          max_prefill_tokens=max_prefill_tokens)
    assert engine.prefill_rows_per_forward == max_prefill_tokens // PREFILL_ROW
    requests = list(zip([2, 0, 3, 1], random_prompts([5, 130, 64, 1]), strict=True))
    logits, hidden, aux = prefill_one_by_one(engine, requests)
    k, v = engine.cache.k.clone(), engine.cache.v.clone()
    engine.cache.k.zero_()
    engine.cache.v.zero_()

    out = engine.prefill(requests)
    assert close(out.logits, logits, 1e-5)
    assert close(out.hidden, hidden, 1e-5)
    assert close(out.aux_hidden, aux, 1e-5)
    for slot, prompt in requests:
        assert close(engine.cache.k[:, slot, :, :len(prompt)], k[:, slot, :, :len(prompt)], 1e-5)
        assert close(engine.cache.v[:, slot, :, :len(prompt)], v[:, slot, :, :len(prompt)], 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graph_matches_eager():
    """The prefill graphs (prompts cut into rows of PREFILL_ROW, padded to a captured number of rows, as many
    replays as the rows need) give what eager forwards of the same rows give, touch no other slot, and hand
    back tensors the next replay leaves alone."""
    engine = TargetEngine(device="cuda", dtype=torch.float32, max_slots=8, max_context=256, aux_layers=(1,),
                          max_verify_tokens=5, checkpoint=tiny_checkpoint(),
                          prefill_graph_tokens=8 * PREFILL_ROW)
    assert engine.prefill_graphs.sizes == [1, 2, 4, 8]
    for lengths in ([5, 130, 64, 1, 65], [200, 200, 130, 3]):  # 8 rows: one replay; 4 + 4 + 3 + 1: two
        slots = [6, 0, 3, 1, 4][:len(lengths)]
        requests = list(zip(slots, random_prompts(lengths), strict=True))
        before = (engine.cache.k.clone(), engine.cache.v.clone())

        graph = engine.prefill(requests)
        after_graph = (engine.cache.k.clone(), engine.cache.v.clone())
        engine.cache.k.copy_(before[0])
        engine.cache.v.copy_(before[1])
        chunks = prefill_rows(requests, PREFILL_ROW).chunks(engine.prefill_rows_per_forward)
        eager = [engine._prefill_chunk(chunk, graph=False) for chunk in chunks]

        assert graph.logits.shape == (len(lengths), 512)
        assert close(graph.logits, torch.cat([e.logits for e in eager]), 1e-5)
        assert close(graph.hidden, torch.cat([e.hidden for e in eager]), 1e-5)
        assert close(graph.aux_hidden, torch.cat([e.aux_hidden for e in eager]), 1e-5)
        for slot, prompt in requests:
            assert close(after_graph[0][:, slot, :, :len(prompt)], engine.cache.k[:, slot, :, :len(prompt)],
                         1e-5)
        untouched = [s for s in range(engine.max_slots) if s not in slots]
        assert torch.equal(after_graph[0][:, untouched], before[0][:, untouched])
        assert torch.equal(after_graph[1][:, untouched], before[1][:, untouched])

    kept = graph.logits.clone()
    engine.prefill([(5, [9, 8, 7])])
    assert torch.equal(graph.logits, kept)
