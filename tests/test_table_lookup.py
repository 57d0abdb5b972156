"""The lookup of tables ahead (kernels/table_lookup.py): the Triton program (on a CPU, Triton's interpreter)
against the torch reference on random tables: hits by the exact outcome, forced hits by the number of
accepted drafts, requests without a table, failed sampler rows, rows of other requests in the sampler's
output; and its publication, which must happen only when every request hit. On a GPU, the number goes into a
slot of mapped host memory (stream_values.HostSlot) as the verifier's GPU waits on it."""

import pytest
import torch
from specwire.kernels.table_lookup import Address, Lookup, Publish, Table, look_up_ref

from specwire.stream_values import HostSlot

table_lookup_triton = pytest.importorskip("specwire.kernels.table_lookup_triton")

N, K, TRASH, VOCAB = 5, 3, 99, 7


def random_case(B: int, seed: int, all_hit: bool):
    """A table of B requests (N branches each, a few not held) and a sampler output whose rows (shuffled,
    one spare) settle, per request, a held branch's outcome, a bonus no branch has, or nothing."""
    g = torch.Generator().manual_seed(seed)
    rows = B * N + 3
    slots = torch.where(torch.rand(rows, generator=g) < 0.15, TRASH, torch.arange(rows))
    score = torch.where(torch.rand(rows, generator=g) < 0.15, 0.0, torch.rand(rows, generator=g) + 0.1)
    accepted = torch.randint(0, K + 1, (rows,), generator=g)
    bonus = torch.randint(0, VOCAB, (rows,), generator=g)
    table = Table(slots, score, accepted, bonus, torch.randint(0, 1000, (rows, K), generator=g), TRASH, N)
    first = torch.randperm(B, generator=g) * N
    first[torch.rand(B, generator=g) < (0 if all_hit else 0.2)] = -1  # no table
    settled = torch.full((B + 1, K + 2), -1, dtype=torch.int64)
    order = torch.randperm(B + 1, generator=g)[:B]
    for b in range(B):
        held = [i for i in range(N) if first[b] >= 0 and table.slots[first[b] + i] != TRASH
                and table.score[first[b] + i] > 0]
        kind = 0 if all_hit else int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0 and not held:
            first[b], held = 0, [i for i in range(N) if table.slots[i] != TRASH and table.score[i] > 0]
        if kind == 2:
            continue  # a failed row: count -1
        if kind == 0:
            i = held[int(torch.randint(0, len(held), (1,), generator=g))]
            a, c = int(table.accepted[first[b] + i]), int(table.bonus[first[b] + i])
        else:
            a, c = int(torch.randint(0, K + 1, (1,), generator=g)), VOCAB + 5  # a bonus no branch has
        settled[order[b], 0] = a + 1
        settled[order[b], 1:a + 1] = torch.randint(0, VOCAB, (a,), generator=g)
        settled[order[b], a + 1] = c
    draws = torch.rand(B, generator=g)
    return settled, order, first, table, draws


def outputs(capacity: int) -> Lookup:
    return Lookup(torch.full((capacity,), -7, dtype=torch.int64),
                  torch.full((capacity, K), -7, dtype=torch.int64), torch.zeros((), dtype=torch.int32))


@pytest.mark.parametrize("rate", [None, 0.5, 1.0])
@pytest.mark.parametrize("B, all_hit", [(1, True), (3, True), (6, False), (13, False)])
def test_the_program_finds_what_the_reference_finds_and_publishes_only_all_hits(B, all_hit, rate):
    for seed in range(4):
        settled, rows, first, table, draws = random_case(B, seed, all_hit)
        draws = None if rate is None else draws
        got, want = outputs(16), outputs(16)
        published = {}
        for out, run in ((got, table_lookup_triton.look_up), (want, look_up_ref)):
            buffer, slot = torch.full((16 * K,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            run(settled, rows, first, table, draws, rate or 0.0, out, Publish(buffer, slot, 41))
            published[run] = (buffer, slot)
        assert torch.equal(got.hit_index[:B], want.hit_index[:B]), (seed, got.hit_index, want.hit_index)
        hit = want.hit_index[:B] >= 0
        assert torch.equal(got.drafts[:B][hit], want.drafts[:B][hit])
        assert int(got.all_hit) == int(want.all_hit) == int(bool(hit.all()))
        (got_buffer, got_slot), (want_buffer, want_slot) = published.values()
        assert torch.equal(got_buffer, want_buffer) and int(got_slot) == int(want_slot)
        if hit.all():
            assert int(got_slot) == 41 and torch.equal(got_buffer[:B * K].view(B, K), want.drafts[:B])
        else:
            assert int(got_slot) == 0 and (got_buffer == -1).all()
        if all_hit:
            assert hit.all()


def test_the_reference_takes_the_first_held_branch_of_the_outcome():
    """A hand-made table: the exact outcome wins over an earlier branch of the same count; a forced hit takes
    the first (likeliest) branch of the count; a branch not held (trash slot, score 0) is never taken."""
    tokens = torch.arange(4 * K).view(4, K)
    table = Table(torch.tensor([0, 1, TRASH, 3]), torch.tensor([0.9, 0.5, 0.4, 0.0]),
                  torch.tensor([1, 1, 1, 1]), torch.tensor([4, 5, 6, 5]), tokens, TRASH, 4)
    settled = torch.tensor([[2, 8, 5, -1, -1], [2, 8, 6, -1, -1], [2, 8, 3, -1, -1]])
    rows, first = torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0])
    out = outputs(3)
    look_up_ref(settled, rows, first, table, None, 0.0, out)
    assert out.hit_index.tolist() == [1, -1, -1] and out.drafts[0].tolist() == tokens[1].tolist()
    look_up_ref(settled, rows, first, table, torch.tensor([0.9, 0.1, 0.1]), 0.5, out)
    assert out.hit_index.tolist() == [1, 0, 0] and int(out.all_hit) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_publishes_into_a_mapped_slot_only_when_every_request_hit():
    slot = HostSlot()
    try:
        for all_hit in (False, True):
            settled, rows, first, table, draws = random_case(6, 3, all_hit)
            cuda = [t.cuda() for t in (settled, rows, first)]
            table = Table(*(t.cuda() for t in table[:5]), TRASH, N)
            out = Lookup(*(t.cuda() for t in outputs(8)))
            buffer = torch.full((8 * K,), -1, dtype=torch.int64, device="cuda")
            publish = Publish(buffer, Address(slot.address), 5)
            table_lookup_triton.look_up(*cuda, table, None, 0.0, out, publish)
            torch.cuda.synchronize()
            assert int(out.all_hit) == int(all_hit) and slot.value == (5 if all_hit else 0)
            assert (buffer[:6 * K].view(6, K) == out.drafts[:6]).all() if all_hit else (buffer == -1).all()
    finally:
        slot.unlink()
        slot.close()
